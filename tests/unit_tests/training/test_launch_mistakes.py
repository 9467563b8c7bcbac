"""Mistakes common in Megatron-LM launch lines get an error that names the flag and says what to do."""

import pytest

from megatron.training.arguments import parse_args
from tests.unit_tests.training.argument_checks import BASE, validated


def argparse_error(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(args=argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("flag, value, message", [
    ("--lr", "-1e-3", r"--lr must be >= 0, got -0\.001"),
    ("--lr", "-2E+2", r"--lr must be >= 0, got -200\.0"),
    ("--min-lr", "-1e-5", r"--min-lr must be >= 0, got -1e-05"),
])
def test_negative_numbers_in_scientific_notation_reach_the_rule_that_names_them(flag, value, message):
    with pytest.raises(ValueError, match=message):
        validated(f"{flag} {value}", base=BASE.replace("--lr 1e-3", "--lr 1e-3" if flag != "--lr" else ""))


def test_negative_values_parse_as_values_and_flags_still_parse_as_flags():
    args = parse_args(args=BASE.split() + ["--seed", "-3", "--lr-warmup-init", "-0.5e-3", "--min-lr", "-.5",
                                           "--clip-grad", "-7E2"])
    assert (args.seed, args.lr_warmup_init, args.min_lr, args.clip_grad) == (-3, -0.0005, -0.5, -700.0)
    assert parse_args(args=BASE.split() + ["--fp16"]).fp16 is True


@pytest.mark.parametrize("typo, suggestion", [
    ("--micro-batch-sizes", "did you mean --micro-batch-size?"),
    ("--tensor-parallel-size", "did you mean --tensor-model-parallel-size?"),
    ("--use-dist-optimizer", "did you mean --use-distributed-optimizer?"),
])
def test_a_misspelled_flag_gets_the_closest_real_one(typo, suggestion, capsys):
    error = argparse_error(BASE.split() + [typo, "2"], capsys)
    assert f"unrecognized arguments: {typo} 2 (not a flag of pretrain_gpt.py: check its spelling; {suggestion};" \
        in error


def test_several_misspelled_flags_each_get_theirs_and_unrelated_ones_none(capsys):
    error = argparse_error(BASE.split() + ["--num-layer", "3", "--globl-batch-size=8", "--zzz-unrelated"], capsys)
    assert ("check its spelling; did you mean --num-layers for --num-layer?; did you mean --global-batch-size for "
            "--globl-batch-size?; the flags it takes") in error
    assert "--zzz-unrelated?" not in error


def test_argparse_errors_are_not_buried_under_the_full_usage(capsys):
    error = argparse_error(BASE.split() + ["--ckpt-format", "torch-dist"], capsys)
    lines = error.strip().splitlines()
    assert len(lines) == 2, lines
    assert lines[0].endswith("[flags] (--help lists them)")
    assert "argument --ckpt-format: invalid choice: 'torch-dist'" in lines[1]


def test_save_under_a_file_fails_at_validation(tmp_path):
    blocking = tmp_path / "not_a_dir"
    blocking.write_text("")
    for save in (blocking / "ckpt", blocking / "a" / "b"):
        with pytest.raises(ValueError, match=f"--save {save} cannot be created: {blocking} is a file, not a "
                           "directory; point --save at a directory path"):
            validated(f"--save {save}")
    assert validated(f"--save {tmp_path / 'new' / 'ckpt'}").save == str(tmp_path / "new" / "ckpt")
    assert not (tmp_path / "new").exists()  # validation creates nothing
