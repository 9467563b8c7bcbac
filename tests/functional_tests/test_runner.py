"""The functional-test runner itself: case files, flag conversion and the comparisons that decide pass/fail."""

from pathlib import Path

import pytest

from tests.functional_tests import runner


def test_model_args_become_flags():
    argv = runner.model_args_to_argv({"--num-layers": 4, "--mock-data": True, "--bf16": False, "--data-path": [0.3, "a", 0.7, "b"]})
    assert argv == ["--num-layers", "4", "--mock-data", "--data-path", "0.3", "a", "0.7", "b"]


def test_every_case_loads_and_has_golden_values_for_its_metrics():
    names = runner.list_cases("gpt")
    assert "gpt/single_rank" in names
    for name in names:
        case = runner.load_case(name)
        golden = runner.load_golden(case)
        for metric in case.metrics:
            spec = golden[metric]
            assert (spec["start_step"], spec["end_step"], spec["step_interval"]) == (1, case.train_iters, 1)
            assert len(spec["values"]) == case.train_iters


def test_loss_comparison_is_tight_and_reports_every_problem():
    case = runner.load_case("gpt/single_rank")
    golden = runner.load_golden(case)
    metrics = {
        metric: {int(step): value for step, value in spec["values"].items()} for metric, spec in golden.items()
    }
    assert runner.compare_with_golden(case, metrics, golden) == []

    metrics["lm loss"][3] *= 1 + 2e-6  # a drift just above the 1e-6 bound
    metrics["lm loss"][2] *= 1 + 5e-7  # within it
    metrics["num-zeros"][4] += 13  # beyond the accidental zeros a kernel change makes
    metrics["num-zeros"][1] += 12  # within them
    del metrics["lm loss"][case.train_iters]
    metrics["mem-allocated-bytes"][2] *= 1.04  # within the 5% memory tolerance
    problems = runner.compare_with_golden(case, metrics, golden)
    assert len(problems) == 3
    assert problems[0] == f"lm loss: no value for iterations [{case.train_iters}]"
    assert problems[1].startswith("lm loss @ 3:") and "> 1e-06" in problems[1]
    assert problems[2].startswith("num-zeros @ 4:")


def test_missing_golden_file_says_how_to_create_it(tmp_path, monkeypatch):
    case = runner.load_case("gpt/single_rank")
    monkeypatch.setattr(runner.FunctionalCase, "golden_path", property(lambda self: tmp_path / "missing.json"))
    with pytest.raises(FileNotFoundError, match="python -m tests.functional_tests.regenerate_golden gpt/single_rank"):
        runner.load_golden(case)


def test_unknown_case_keys_are_rejected(tmp_path, monkeypatch):
    (tmp_path / "gpt" / "broken").mkdir(parents=True)
    (tmp_path / "gpt" / "broken" / "model_config.yaml").write_text("MODEL_ARGS: {--train-iters: 2}\nGPUS: 8\n")
    monkeypatch.setattr(runner, "CASES_DIR", tmp_path)
    with pytest.raises(ValueError, match=r"unknown keys \['GPUS'\]"):
        runner.load_case("gpt/broken")


def test_a_resume_in_another_layout_loads_with_its_flags(tmp_path, monkeypatch):
    """RESUME_MODEL_ARGS reach only the launch that loads the checkpoint (`false` drops a flag there)."""
    case = runner.load_case("gpt/resume_cp2_megatron_fsdp_to_cp1_ddp")
    assert case.resumes_in_another_layout and case.resume_model_args["--context-parallel-size"] is False
    launched = {}
    monkeypatch.setattr(runner, "launch", lambda case, workdir, extra, timeout_s, tag: launched.setdefault(tag, extra))
    runner.run_case(case, tmp_path)
    saved_in = str(tmp_path / "checkpoints")
    half = case.train_iters // 2
    assert launched["full"] == {"--save": saved_in, "--save-interval": half, "--ckpt-format": "torch_dist"}
    second = runner.model_args_to_argv({**case.model_args, **launched["resumed"]})
    assert "--context-parallel-size" in runner.model_args_to_argv(case.model_args)
    assert not {"--context-parallel-size", "--use-megatron-fsdp", "--save"} & set(second)
    assert second[second.index("--load") + 1] == saved_in and second[second.index("--ckpt-step") + 1] == str(half)
    (tmp_path / "gpt" / "regular").mkdir(parents=True)
    (tmp_path / "gpt" / "regular" / "model_config.yaml").write_text(
        "MODEL_ARGS: {--train-iters: 2}\nRESUME_MODEL_ARGS: {--context-parallel-size: false}\n")
    monkeypatch.setattr(runner, "CASES_DIR", tmp_path)
    with pytest.raises(ValueError, match="RESUME_MODEL_ARGS needs TEST_TYPE ckpt-resume"):
        runner.load_case("gpt/regular")


def test_forked_ranks_train_as_torchrun_ranks(runs, tmp_path):
    """The default launcher forks ranks from a server that imported torch and Megatron once (fork_launcher.py);
    a torchrun launch of the same case gives the same metrics to the last bit (same code, thread counts, seeds)."""
    case = runner.load_case("gpt/dp2_ddp")
    forked = runs.uninterrupted(case)  # the run the golden-value and reference tests use
    launched = runner.launch(case, tmp_path, tag="torchrun", launcher="torchrun")
    for metric in ("lm loss", "grad norm", "num-zeros", "params-bytes", "grads-bytes", "optimizer-state-bytes"):
        assert sorted(launched[metric]) == list(range(1, case.train_iters + 1)), metric
        assert launched[metric] == forked[metric], metric


def test_a_failing_rank_fails_the_launch_with_its_log(tmp_path):
    case = runner.load_case("gpt/dp2_ddp")
    with pytest.raises(RuntimeError, match=r"(?s)gpt/dp2_ddp \(broken\) failed: .*--num-attention-heads"):
        runner.launch(case, tmp_path, {"--num-attention-heads": 5}, tag="broken")


def _write_case(tmp_path, monkeypatch, text, name="gpt/upstream_style"):
    (tmp_path / name).mkdir(parents=True)
    (tmp_path / name / "model_config.yaml").write_text(text)
    monkeypatch.setattr(runner, "CASES_DIR", tmp_path)
    return runner.load_case(name)


UPSTREAM_STYLE_ARGS = """MODEL_ARGS:
  --train-iters: 6
  --save: ${CHECKPOINT_SAVE_PATH}
  --load: ${CHECKPOINT_LOAD_PATH}
  --tensorboard-dir: ${TENSORBOARD_PATH}
  --data-cache-path: ${DATA_CACHE_PATH}
"""


def test_upstream_placeholders_name_the_launch_directories(tmp_path, monkeypatch):
    """${CHECKPOINT_SAVE_PATH} and the like become directories of the launch; --load ${CHECKPOINT_LOAD_PATH} is left
    out (a run starts from scratch) unless the harness loads a checkpoint itself."""
    from tests.functional_tests import fork_launcher

    case = _write_case(tmp_path / "cases", monkeypatch, UPSTREAM_STYLE_ARGS)
    launched = []

    class RecordingLauncher:
        def launch(self, argv, env, nproc, cwd, log, timeout_s):
            launched.append(argv)
            Path(argv[argv.index("--metrics-file") + 1]).write_text('{"iteration": 1, "lm loss": 1.5}\n')
            return {"returncodes": [0] * nproc, "timed_out": False}

    monkeypatch.setattr(fork_launcher, "launcher_for", lambda case_env, env: RecordingLauncher())
    workdir = tmp_path / "work"
    assert runner.launch(case, workdir, launcher="fork") == {"lm loss": {1: 1.5}}
    runner.launch(case, workdir, {"--load": "saved", "--ckpt-step": 3}, launcher="fork", tag="resumed")
    first, resumed = launched
    assert first[first.index("--save") + 1] == str(workdir / "checkpoints")
    assert first[first.index("--tensorboard-dir") + 1] == str(workdir / "tensorboard")
    assert first[first.index("--data-cache-path") + 1] == str(workdir / "data_cache")
    assert "--load" not in first and not any("$" in item for item in first + resumed)
    assert resumed[resumed.index("--load") + 1] == "saved"


@pytest.mark.parametrize("value, message", [
    ("${DATA_PATH}/my-gpt3_00_text_document",
     r"MODEL_ARGS --data-path: '\$\{DATA_PATH\}/my-gpt3_00_text_document': .*--mock-data"),
    ("${NUM_NODES}", r"--data-path: '\$\{NUM_NODES\}': \$\{NUM_NODES\} is not defined here.*CHECKPOINT_SAVE_PATH"),
    ("${CHECKPOINT_LOAD_PATH}/iter_1", r"CHECKPOINT_LOAD_PATH\} may only be a whole value"),
], ids=["data-path", "undefined", "load-path-inside-a-value"])
def test_undefined_placeholders_are_refused_by_name(tmp_path, monkeypatch, value, message):
    with pytest.raises(ValueError, match=message):
        _write_case(tmp_path, monkeypatch, f"MODEL_ARGS:\n  --train-iters: 6\n  --data-path: {value}\n")


def test_exit_interval_ends_every_launch_of_a_case(tmp_path, monkeypatch):
    case = _write_case(tmp_path, monkeypatch, "TEST_TYPE: ckpt-resume\nMODEL_ARGS:\n  --train-iters: 8\n"
                                              "  --exit-interval: 4\n")
    assert case.train_iters == 4
    assert runner.checkpoint_args(case, tmp_path)["--save-interval"] == 2
    later = _write_case(tmp_path, monkeypatch, "MODEL_ARGS:\n  --train-iters: 8\n  --exit-interval: 10\n",
                        name="gpt/exit_after_the_end")
    assert later.train_iters == 8


def test_upstream_ci_env_vars_are_dropped_or_refused(tmp_path, monkeypatch):
    case = _write_case(tmp_path, monkeypatch, "ENV_VARS:\n  N_REPEAT: 5\n  NCCL_ALGO: Ring\n"
                                              "MODEL_ARGS:\n  --train-iters: 6\n")
    assert case.env_vars == {"NCCL_ALGO": "Ring"}
    with pytest.raises(ValueError, match="ENV_VARS SKIP_PYTEST: every case here is compared"):
        _write_case(tmp_path, monkeypatch, "ENV_VARS:\n  SKIP_PYTEST: 1\nMODEL_ARGS:\n  --train-iters: 6\n",
                    name="gpt/skipped")
    with pytest.raises(ValueError, match="unknown keys \\['SPEC'\\]; a case has NPROC_PER_NODE, ENV_VARS"):
        _write_case(tmp_path, monkeypatch, "SPEC: x\nMODEL_ARGS:\n  --train-iters: 6\n", name="gpt/spec")


def test_a_golden_mismatch_says_what_differed_and_how_to_re_record():
    case = runner.load_case("gpt/single_rank")
    golden = runner.load_golden(case)
    metrics = {metric: {int(step): value for step, value in spec["values"].items()} for metric, spec in golden.items()}
    metrics["num-zeros"][2] += 13
    problems = runner.compare_with_golden(case, metrics, golden)
    assert problems == [f"num-zeros @ 2: expected {golden['num-zeros']['values']['2']!r}, "
                        f"got {metrics['num-zeros'][2]!r} (abs. diff 13 > 12.0 + 0.0 x |expected|)"]
    message = runner.golden_mismatch_message(case, problems)
    assert message.splitlines()[1] == problems[0]
    assert "re-record the golden values with: python -m tests.functional_tests.regenerate_golden gpt/single_rank" in (
        message)
