"""Upstream checkpoint and data flags parse, and each rule or unsupported case fails with a message naming the
flag (and what to use instead); the deprecated aliases map to --ckpt-format."""

import pytest

from megatron.training.arguments import parse_args, validate_args

BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
        "--train-iters 10 --lr 1e-3 --vocab-size 128")


@pytest.fixture(autouse=True)
def single_process_env(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")


def validated(extra):
    return validate_args(parse_args(args=f"{BASE} {extra}".split()))


@pytest.mark.parametrize("extra, message", [
    ("--use-dist-ckpt --ckpt-format torch", "--use-dist-ckpt asks for the torch_dist format but --ckpt-format is "
                                            "torch"),
    ("--dist-ckpt-format zarr", "--dist-ckpt-format zarr: the zarr format is not supported.*--ckpt-format "
                                "torch_dist"),
    ("--ckpt-convert-format zarr --load a --ckpt-convert-save b", "--ckpt-convert-format zarr.*not supported"),
    ("--ckpt-convert-format torch_dist --load a", "needs --load DIR .* and --ckpt-convert-save DIR"),
    ("--ckpt-convert-save b", "--ckpt-convert-save needs --ckpt-convert-format"),
    ("--ckpt-convert-format torch --load a --ckpt-convert-save b --use-megatron-fsdp",
     "--ckpt-convert-format torch: .*convert with --ckpt-convert-format torch_dist"),
    ("--save-retain-interval 0 --save s", "--save-retain-interval must be positive"),
    ("--save-retain-interval 4", "--save-retain-interval needs --save"),
    ("--save-retain-interval 5 --save s --save-interval 2", "--save-retain-interval 5 must be a multiple of "
                                                             "--save-interval 2"),
    ("--save-retain-interval 4 --save s --keep-last-n 2", "--save-retain-interval and --keep-last-n"),
    ("--non-persistent-save-interval 3", "--non-persistent-save-interval needs --save DIR"),
    ("--non-persistent-save-interval 3 --save s --ckpt-format torch", "needs --ckpt-format torch_dist"),
    ("--non-persistent-ckpt-type local", "--non-persistent-ckpt-type local needs --non-persistent-local-ckpt-dir"),
    ("--non-persistent-ckpt-type local --non-persistent-save-interval 2",
     "--non-persistent-ckpt-type local needs --non-persistent-local-ckpt-dir"),
    ("--non-persistent-ckpt-type local --non-persistent-local-ckpt-dir /l --non-persistent-save-interval 0",
     "--non-persistent-save-interval must be positive"),
    ("--non-persistent-ckpt-type in_memory", "--non-persistent-ckpt-type in_memory: .* not supported; use "
                                             "--non-persistent-ckpt-type local"),
    ("--non-persistent-local-ckpt-dir /l", "--non-persistent-local-ckpt-dir needs --non-persistent-ckpt-type local"),
    ("--non-persistent-local-ckpt-algo atomic", "--non-persistent-local-ckpt-algo needs --non-persistent-ckpt-type "
                                                "local"),
    ("--use-mp-args-from-checkpoint-args", "--use-mp-args-from-checkpoint-args needs --use-checkpoint-args"),
    ("--use-checkpoint-args", "--use-checkpoint-args needs --load"),
])
def test_checkpoint_flag_rules_name_the_flags(extra, message):
    with pytest.raises(ValueError, match=message):
        validated(f"--mock-data {extra}")


def test_deprecated_aliases_map_to_the_torch_dist_format(capsys):
    assert validated("--mock-data --use-dist-ckpt").ckpt_format == "torch_dist"
    assert validated("--mock-data --dist-ckpt-format torch_dist").ckpt_format == "torch_dist"
    assert "--use-dist-ckpt is deprecated; use --ckpt-format torch_dist" in capsys.readouterr().out
    args = validated("--mock-data --save s --save-interval 2 --save-retain-interval 4 --non-persistent-save-interval 1 "
                     "--auto-detect-ckpt-format")
    assert (args.save_retain_interval, args.non_persistent_save_interval, args.non_persistent_ckpt_type,
            args.auto_detect_ckpt_format) == (4, 1, "global", True)


def test_local_non_persistent_checkpoints_need_no_save_dir():
    args = validated("--mock-data --non-persistent-ckpt-type local --non-persistent-local-ckpt-dir /l "
                     "--non-persistent-save-interval 2")
    assert (args.non_persistent_ckpt_type, args.non_persistent_local_ckpt_dir,
            args.non_persistent_local_ckpt_algo) == ("local", "/l", "fully_parallel")
    assert validated("--mock-data --non-persistent-ckpt-type local --non-persistent-local-ckpt-dir /l "
                     "--non-persistent-local-ckpt-algo atomic").non_persistent_local_ckpt_algo == "atomic"


def test_use_checkpoint_args_without_a_checkpoint(tmp_path, capsys):
    args = validated(f"--mock-data --use-checkpoint-args --load {tmp_path}")
    assert args.hidden_size == 64
    assert "holds no checkpoint; the model is built from the command line" in capsys.readouterr().out
    with pytest.raises(FileNotFoundError, match="--exit-on-missing-checkpoint"):
        validated(f"--mock-data --use-checkpoint-args --load {tmp_path} --exit-on-missing-checkpoint")


@pytest.mark.parametrize("extra, message", [
    ("--mock-data --object-storage-cache-path /c", "--object-storage-cache-path is not supported"),
    ("--mock-data --s3-cache-path /c", "--s3-cache-path is not supported"),
    ("--mock-data --full-validation", "--full-validation needs validation datasets of a known size"),
    ("--mock-data --multiple-validation-sets", "--multiple-validation-sets needs validation datasets"),
    ("--data-path a --dataloader-type external --full-validation --tokenizer-type NullTokenizer",
     "--full-validation needs the validation datasets themselves; with --dataloader-type external"),
    ("--train-data-path a --valid-data-path 0.5 b 0.5 c --multiple-validation-sets --tokenizer-type NullTokenizer",
     "--multiple-validation-sets evaluates each validation dataset on its own, so --valid-data-path must list "
     "prefixes without weights"),
    ("--data-path 0.5 a 0.5 b --multiple-validation-sets --tokenizer-type NullTokenizer",
     "so --data-path must list prefixes without weights"),
    ("--mock-data --num-dataset-builder-threads 0", "--num-dataset-builder-threads must be at least 1"),
    ("--mock-data --mid-level-dataset-surplus -1", "--mid-level-dataset-surplus must be >= 0"),
    ("--mock-data --reset-attention-mask --no-create-attention-mask-in-dataloader",
     "--reset-attention-mask needs the dataset's attention mask"),
    ("--data-path a --train-data-path b --tokenizer-type NullTokenizer", "--data-path .* are exclusive"),
    ("--valid-data-path b --tokenizer-type NullTokenizer", "need --train-data-path too"),
    ("--mock-data --train-data-path b", "--mock-data and --train/valid/test-data-path are exclusive"),
    ("--train-data-path b", "--tokenizer-type is required with --data-path / --train-data-path"),
    ("--data-path a --data-args-path f --tokenizer-type NullTokenizer", "--data-path and --data-args-path"),
    ("--data-args-path /nonexistent --tokenizer-type NullTokenizer", "--data-args-path /nonexistent: no such file"),
    ("--per-split-data-args-path /nonexistent --tokenizer-type NullTokenizer", "--per-split-data-args-path"),
])
def test_data_flag_rules_name_the_flags(extra, message):
    with pytest.raises(ValueError, match=message):
        validated(extra)


def test_skip_train_evaluates_from_validation_and_test_paths_alone():
    """As upstream, evaluating a loaded model (--skip-train) needs no --train-data-path."""
    args = validated("--valid-data-path b --test-data-path c --skip-train --tokenizer-type NullTokenizer")
    assert (args.train_data_path, args.valid_data_path, args.test_data_path) == (None, ["b"], ["c"])


def test_data_flags_defaults_and_accepted_values(tmp_path):
    args = validated("--mock-data")
    assert (args.dataloader_type, args.mmap_bin_files, args.num_dataset_builder_threads,
            args.mid_level_dataset_surplus, args.create_attention_mask_in_dataloader, args.no_shared_fs) == (
        "single", True, 1, 0.005, True, False)
    args = validated("--mock-data --dataloader-type cyclic --no-mmap-bin-files "
                     "--no-create-attention-mask-in-dataloader --no-shared-fs --num-dataset-builder-threads 4")
    assert (args.dataloader_type, args.mmap_bin_files, args.create_attention_mask_in_dataloader, args.no_shared_fs,
            args.num_dataset_builder_threads) == ("cyclic", False, False, True, 4)
    args = validated("--train-data-path a --valid-data-path b c --multiple-validation-sets --full-validation "
                     "--tokenizer-type NullTokenizer")
    assert (args.multiple_validation_sets, args.full_validation, args.valid_data_path) == (True, True, ["b", "c"])
    bad_json = tmp_path / "splits.json"
    bad_json.write_text('{"training": ["a"]}')
    with pytest.raises(ValueError, match=r'keys "train", "valid", "test"; found \[\'training\'\]'):
        validated(f"--per-split-data-args-path {bad_json} --tokenizer-type NullTokenizer")


def test_checkpoint_args_override_the_model_and_with_mp_args_the_layout():
    import argparse

    from megatron.training.checkpoint_args import apply_checkpoint_args

    saved = argparse.Namespace(hidden_size=32, num_layers=4, ffn_hidden_size=64, swiglu=True, vocab_file="/old/v",
                               tensor_model_parallel_size=2, pipeline_model_parallel_size=1)
    command_line = dict(hidden_size=64, num_layers=4, ffn_hidden_size=None, swiglu=False, vocab_file="/new/v",
                        tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    args = argparse.Namespace(**command_line)
    changed = apply_checkpoint_args(args, saved)
    assert (args.hidden_size, args.ffn_hidden_size, args.swiglu, args.vocab_file) == (32, 64, True, "/new/v")
    assert args.tensor_model_parallel_size == 1
    assert changed == ["--hidden-size 32 (command line: 64)", "--swiglu True (command line: False)"]
    args = argparse.Namespace(**command_line)
    apply_checkpoint_args(args, saved, with_parallel_layout=True)
    assert args.tensor_model_parallel_size == 2
