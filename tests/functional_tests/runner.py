"""Runs a functional test case end to end and compares its metrics with golden values.

A case is a folder `test_cases/<model>/<case>/` with `model_config.yaml`:

    NPROC_PER_NODE: 2            # ranks torchrun starts (default 1)
    ENV_VARS: {NAME: value}      # extra environment of the run
    TEST_TYPE: regular           # or ckpt-resume
    MODEL_ARGS: {--flag: value}  # `true` = bare flag, `false` = left out, a list = several values
    METRICS: [lm loss, num-zeros, mem-allocated-bytes]   # optional; these are the defaults
    RESUME_MODEL_ARGS: {--flag: value}  # ckpt-resume only, optional: the flags the resumed launch changes

and `golden_values_cpu.json`: metric -> {"start_step", "end_step", "step_interval", "values": {"1": ...}}.

The run is `torchrun --nproc-per-node N pretrain_gpt.py <MODEL_ARGS> --metrics-file <tmp>`; the metrics
file holds one JSON record per iteration (see `megatron.training.training_log`). A `ckpt-resume` case trains
N iterations uninterrupted, saving a checkpoint at N/2 on the way; a second launch loads that checkpoint
(`--ckpt-step N/2`) and trains to N. Its metrics are the uninterrupted run's, and `resumed_metrics` holds the
second launch's. Golden values are the uninterrupted run's (saving does not change what a run trains).

`RESUME_MODEL_ARGS` makes a resume across layouts: the launch that loads the checkpoint runs with these flags
over MODEL_ARGS (`false` drops a flag), e.g. a checkpoint saved under CP2 and Megatron-FSDP resumed under CP1 DDP,
or one saved with an interleaved pipeline resumed without it. It must train the same model on the same ranks.

Cases written for upstream's CI carry over:
- `${VAR}` placeholders in MODEL_ARGS name the launch's own directories (`PLACEHOLDER_DIRECTORIES`:
  `${CHECKPOINT_SAVE_PATH}`, `${TENSORBOARD_PATH}`, `${DATA_CACHE_PATH}`); a flag whose value is
  `${CHECKPOINT_LOAD_PATH}` is left out, since an uninterrupted run starts from scratch and the resumed launch
  of a ckpt-resume case loads the checkpoint the harness saved. `${DATA_PATH}` and any other variable are
  refused when the case loads: the cases train on `--mock-data`, and nothing else defines them.
- `--exit-interval E` below --train-iters ends every launch at iteration E: `train_iters` is then E, the golden
  values end there, and a ckpt-resume case saves at E/2.
- ENV_VARS `N_REPEAT` (upstream repeats a run to catch nondeterminism) is dropped: CPU runs here are bitwise
  reproducible (`test_runner.py`), so a repeat could only give the same numbers. `SKIP_PYTEST` is refused: every
  case is held to its golden values and its reference.
"""

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

FUNCTIONAL_TESTS_DIR = Path(__file__).resolve().parent
CASES_DIR = FUNCTIONAL_TESTS_DIR / "test_cases"
REPO_ROOT = FUNCTIONAL_TESTS_DIR.parents[1]
GOLDEN_FILENAME = "golden_values_cpu.json"
DEFAULT_METRICS = ("lm loss", "num-zeros", "mem-allocated-bytes")
TEST_TYPES = ("regular", "ckpt-resume")
DEFAULT_TIMEOUT_S = 300

# Tolerances per metric. They must hold on any x86 CPU: the kernels ATen picks (ATEN_CPU_CAPABILITY default /
# avx2 / avx512) and the CPU's BLAS change summation orders. Measured over the golden cases under all three
# capabilities on an AMD EPYC, against goldens written on an Intel Xeon:
# - lm loss: fp32 runs are bitwise reproducible on one machine and kernel set (fixed thread counts, a
#   deterministic gloo ring, no atomics); across kernel sets and CPUs the loss moved by at most 8.5e-8 relative
#   over 10 steps. 1e-6 leaves a 10x margin and stays far below the ~1e-3 a real regression (a wrong gradient
#   scale, a skipped reduction) moves the loss by.
# - num-zeros: the counts are accidental exact zeros, mostly entries of the attention key bias gradient, which is
#   zero up to rounding (a bias added to every key shifts each row of scores by a constant, which the softmax
#   ignores), plus fp32 cancellations and underflows elsewhere: a few per step, different on every kernel set.
#   Measured: at most 6 apart from the golden count (cp2_megatron_fsdp_z3 at step 3 under
#   ATEN_CPU_CAPABILITY=default, 1 or 2 in each of six key-bias shards). An absolute tolerance of 12 covers them
#   with a margin; anything structural (a bias vector or an embedding row left without gradient is >= 64
#   entries) is far outside it.
# - memory on CPU is the bytes of tensors the rank holds: exact unless the layout changes, 5% as upstream.
#   Peak RSS depends on the allocator: loose.
RELATIVE_TOLERANCE = {
    "lm loss": 1e-6,
    "num-zeros": 0.0,
    "mem-allocated-bytes": 0.05,
    "mem-max-allocated-bytes": 0.5,
    "iteration-time": None,  # not compared: CPU timing spread on shared machines is 10-30%
}
ABSOLUTE_TOLERANCE = {"num-zeros": 12.0}
# yaml.safe_load's rules, parsed by libyaml where PyYAML has it: every test of the session loads the cases it uses
# (several hundred loads), 4 ms each in Python against 0.6 ms.
YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

CONFIG_KEYS = ("NPROC_PER_NODE", "ENV_VARS", "TEST_TYPE", "MODEL_ARGS", "METRICS", "RESUME_MODEL_ARGS")
# Upstream's `${VAR}` placeholders that name a directory of the launch: the subdirectory of its workdir.
PLACEHOLDER_DIRECTORIES = {"CHECKPOINT_SAVE_PATH": "checkpoints", "TENSORBOARD_PATH": "tensorboard",
                           "DATA_CACHE_PATH": "data_cache"}
# A flag with this value is left out (see the module docstring).
DROPPED_PLACEHOLDER = "${CHECKPOINT_LOAD_PATH}"
PLACEHOLDER = re.compile(r"\$\{(\w+)\}")
# Upstream ENV_VARS that steer its CI scripts rather than the run.
IGNORED_ENV_VARS = ("N_REPEAT",)
REFUSED_ENV_VARS = {"SKIP_PYTEST": "every case here is compared with its golden values and its reference "
                                   "(CPU runs are deterministic): remove it"}


@dataclasses.dataclass(frozen=True)
class FunctionalCase:
    name: str  # "<model>/<case>"
    directory: Path
    nproc_per_node: int
    env_vars: dict
    model_args: dict
    test_type: str
    metrics: tuple
    resume_model_args: dict = dataclasses.field(default_factory=dict)

    @property
    def resumes_in_another_layout(self):
        return bool(self.resume_model_args)

    @property
    def golden_path(self):
        return self.directory / GOLDEN_FILENAME

    @property
    def train_iters(self):
        """The last iteration a launch trains: --train-iters (for sample-based training --train-samples //
        --global-batch-size, as pretrain), or --exit-interval where that comes first."""
        if "--train-iters" in self.model_args:
            iterations = int(self.model_args["--train-iters"])
        else:
            iterations = int(self.model_args["--train-samples"]) // int(self.model_args["--global-batch-size"])
        exit_interval = self.model_args.get("--exit-interval")
        if exit_interval not in (None, False) and 0 < int(exit_interval) < iterations:
            return int(exit_interval)
        return iterations


def list_cases(model="gpt"):
    return sorted(f"{model}/{path.parent.name}" for path in (CASES_DIR / model).glob("*/model_config.yaml"))


def load_case(name):
    directory = CASES_DIR / name
    config_path = directory / "model_config.yaml"
    if not config_path.is_file():
        raise FileNotFoundError(f"no functional test case {name!r}: {config_path} does not exist")
    config = yaml.load(config_path.read_text(), Loader=YAML_LOADER)
    unknown = set(config) - set(CONFIG_KEYS)
    if unknown:
        raise ValueError(f"{config_path}: unknown keys {sorted(unknown)}; a case has {', '.join(CONFIG_KEYS)}")
    test_type = config.get("TEST_TYPE", "regular")
    if test_type not in TEST_TYPES:
        raise ValueError(f"{config_path}: TEST_TYPE must be one of {TEST_TYPES}, got {test_type!r}")
    model_args = dict(config["MODEL_ARGS"])
    if "--train-iters" not in model_args and not {"--train-samples", "--global-batch-size"} <= set(model_args):
        raise ValueError(f"{config_path}: MODEL_ARGS needs --train-iters (or --train-samples and --global-batch-size)")
    resume_model_args = dict(config.get("RESUME_MODEL_ARGS") or {})
    if resume_model_args and test_type != "ckpt-resume":
        raise ValueError(f"{config_path}: RESUME_MODEL_ARGS needs TEST_TYPE ckpt-resume")
    schedule_or_checkpoint = {"--train-iters", "--train-samples", "--save", "--load", "--exit-interval", "--ckpt-step"}
    if schedule_or_checkpoint & set(resume_model_args):
        raise ValueError(f"{config_path}: RESUME_MODEL_ARGS may change the layout, not the schedule or checkpoint")
    for key, flags in (("MODEL_ARGS", model_args), ("RESUME_MODEL_ARGS", resume_model_args)):
        for flag, value in flags.items():
            _check_placeholders(config_path, key, flag, value)
    env_vars = {key: str(value) for key, value in (config.get("ENV_VARS") or {}).items()
                if key not in IGNORED_ENV_VARS}
    for variable, reason in REFUSED_ENV_VARS.items():
        if variable in env_vars:
            raise ValueError(f"{config_path}: ENV_VARS {variable}: {reason}")
    return FunctionalCase(
        name=name,
        directory=directory,
        nproc_per_node=int(config.get("NPROC_PER_NODE", 1)),
        env_vars=env_vars,
        model_args=model_args,
        test_type=test_type,
        metrics=tuple(config.get("METRICS") or DEFAULT_METRICS),
        resume_model_args=resume_model_args,
    )


def _check_placeholders(config_path, key, flag, value):
    for item in value if isinstance(value, (list, tuple)) else [value]:
        if not isinstance(item, str) or item == DROPPED_PLACEHOLDER:
            continue
        for match in PLACEHOLDER.finditer(item):
            variable = match.group(1)
            if variable in PLACEHOLDER_DIRECTORIES:
                continue
            if variable == "CHECKPOINT_LOAD_PATH":
                raise ValueError(f"{config_path}: {key} {flag}: {item!r}: {DROPPED_PLACEHOLDER} may only be a "
                                 "whole value (the flag is then left out)")
            if variable == "DATA_PATH":
                raise ValueError(f"{config_path}: {key} {flag}: {item!r}: the functional cases have no data sets; "
                                 "train on --mock-data with --tokenizer-type NullTokenizer --vocab-size N instead")
            known = [f"${{{name}}}" for name in PLACEHOLDER_DIRECTORIES] + [DROPPED_PLACEHOLDER]
            raise ValueError(f"{config_path}: {key} {flag}: {item!r}: ${{{variable}}} is not defined here; "
                             f"the placeholders a case may use are {', '.join(known)}")


def expand_placeholders(model_args, workdir):
    """`model_args` with the `${VAR}` directories of a launch in `workdir` filled in (see the module docstring)."""
    def expand(item):
        if not isinstance(item, str):
            return item
        return PLACEHOLDER.sub(lambda match: str(Path(workdir) / PLACEHOLDER_DIRECTORIES[match.group(1)]), item)

    expanded = {}
    for flag, value in model_args.items():
        if value == DROPPED_PLACEHOLDER:
            continue
        expanded[flag] = [expand(item) for item in value] if isinstance(value, (list, tuple)) else expand(value)
    return expanded


def model_args_to_argv(model_args):
    argv = []
    for flag, value in model_args.items():
        if value is False or value is None:
            continue
        argv.append(flag)
        if value is True:
            continue
        argv += [str(item) for item in value] if isinstance(value, (list, tuple)) else [str(value)]
    return argv


def read_metrics(path):
    """{metric: {iteration: value}} from a metrics file's training records (later records win)."""
    metrics = {}
    with open(path) as stream:
        for line in stream:
            record = json.loads(line)
            if record.get("split", "train") != "train":
                continue
            iteration = int(record["iteration"])
            for key, value in record.items():
                if key not in ("iteration", "split"):
                    metrics.setdefault(key, {})[iteration] = value
    return metrics


# How ranks start: "fork" (default) forks them from a server that has imported torch and Megatron once per
# session (see fork_launcher.py); "torchrun" starts them with torchrun. Both run pretrain_gpt.py as __main__ with
# torchrun's environment; test_runner.py holds the two to the same losses.
LAUNCHER_ENV = "MEGATRON_FUNCTIONAL_LAUNCHER"
LAUNCHERS = ("fork", "torchrun")


def launcher_name():
    name = os.environ.get(LAUNCHER_ENV, "fork")
    if name not in LAUNCHERS:
        raise ValueError(f"{LAUNCHER_ENV} must be one of {LAUNCHERS}, got {name!r}")
    return name


def launch(case, workdir, extra_model_args=None, timeout_s=DEFAULT_TIMEOUT_S, tag="run", launcher=None):
    """One launch of the case; returns its metrics. Raises with the log tail if it fails."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    metrics_path = workdir / f"{tag}_metrics.jsonl"
    log_path = workdir / f"{tag}.log"
    if metrics_path.exists():
        metrics_path.unlink()
    model_args = {**case.model_args, **(extra_model_args or {}), "--metrics-file": str(metrics_path)}
    model_args = expand_placeholders(model_args, workdir)
    argv = model_args_to_argv(model_args)
    env = {**os.environ, **case.env_vars}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    launcher = launcher or launcher_name()
    if launcher == "fork":
        from tests.functional_tests.fork_launcher import launcher_for

        log_path.write_text("")
        answer = launcher_for(case.env_vars, env).launch(argv, case.env_vars, case.nproc_per_node, workdir, log_path,
                                                         timeout_s)
        command = ["fork", f"x{case.nproc_per_node}", "pretrain_gpt.py", *argv]
        returncode = (f"timeout after {timeout_s}s" if answer["timed_out"]
                      else next((code for code in answer["returncodes"] if code != 0), 0))
    else:
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            str(case.nproc_per_node), str(REPO_ROOT / "pretrain_gpt.py"), *argv,
        ]  # fmt: skip
        with open(log_path, "w") as log:
            try:
                completed = subprocess.run(
                    command, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s
                )
                returncode = completed.returncode
            except subprocess.TimeoutExpired:
                returncode = f"timeout after {timeout_s}s"
    if returncode != 0:
        tail = "".join(log_path.read_text().splitlines(keepends=True)[-40:])
        raise RuntimeError(f"{case.name} ({tag}) failed: {returncode}\n$ {' '.join(command)}\n{tail}")
    return read_metrics(metrics_path)


@dataclasses.dataclass
class CaseResult:
    metrics: dict  # {metric: {iteration: value}} of the uninterrupted run
    resumed_metrics: dict = None  # ckpt-resume: the launch that loaded its checkpoint of iteration N/2


def checkpoint_args(case, workdir):
    """The flags under which a ckpt-resume case's uninterrupted run in `workdir` saves at N/2 (and at N)."""
    return {"--save": str(Path(workdir) / "checkpoints"), "--save-interval": case.train_iters // 2,
            "--ckpt-format": case.model_args.get("--ckpt-format", "torch")}


def uninterrupted_launch(case, workdir, timeout_s=DEFAULT_TIMEOUT_S):
    """Train `case` from scratch to N (--train-iters); a ckpt-resume case saves at N/2 on the way, as upstream's
    ckpt-resume tests do. Returns its metrics."""
    extra = checkpoint_args(case, workdir) if case.test_type == "ckpt-resume" else None
    return launch(case, workdir, extra, timeout_s, tag="full")


def resumed_launch(case, saved_in, workdir, timeout_s=DEFAULT_TIMEOUT_S):
    """The launch that loads iteration N/2 of the checkpoint `case`'s uninterrupted run saved in `saved_in` and
    trains to N, with RESUME_MODEL_ARGS over MODEL_ARGS. Returns its metrics."""
    saved = checkpoint_args(case, saved_in)
    loading = {"--load": saved["--save"], "--ckpt-step": saved["--save-interval"],
               "--ckpt-format": saved["--ckpt-format"]}
    return launch(case, workdir, {**case.resume_model_args, **loading}, timeout_s, tag="resumed")


def run_case(case, workdir, timeout_s=DEFAULT_TIMEOUT_S):
    """The case's uninterrupted run (and, for ckpt-resume, the launch resumed from its checkpoint)."""
    result = CaseResult(uninterrupted_launch(case, workdir, timeout_s))
    if case.test_type == "ckpt-resume":
        result.resumed_metrics = resumed_launch(case, workdir, workdir, timeout_s)
    return result


def golden_from_metrics(case, metrics):
    golden = {}
    for metric in case.metrics:
        if metric not in metrics:
            raise KeyError(f"{case.name}: the run reported no {metric!r} (have {sorted(metrics)})")
        values = metrics[metric]
        steps = sorted(values)
        golden[metric] = {
            "start_step": steps[0],
            "end_step": steps[-1],
            "step_interval": 1,
            "values": {str(step): values[step] for step in steps},
        }
    return golden


def load_golden(case):
    if not case.golden_path.is_file():
        raise FileNotFoundError(
            f"{case.golden_path} is missing; create it with: python -m tests.functional_tests.regenerate_golden "
            f"{case.name}"
        )
    return json.loads(case.golden_path.read_text())


def compare_series(metric, expected, actual, rtol, atol=0.0):
    """Mismatch descriptions (empty when equal within tolerance) of {iteration: value} series."""
    problems = []
    missing = sorted(set(expected) - set(actual))
    if missing:
        problems.append(f"{metric}: no value for iterations {missing}")
    for iteration in sorted(set(expected) & set(actual)):
        want, got = expected[iteration], actual[iteration]
        if want is None or got is None:
            if want is not got:
                problems.append(f"{metric} @ {iteration}: expected {want}, got {got}")
            continue
        if abs(got - want) > atol + rtol * abs(want):
            if atol:
                bound = f"abs. diff {abs(got - want):.3g} > {atol} + {rtol} x |expected|"
            else:
                relative = abs(got - want) / abs(want) if want else float("inf")
                bound = f"rel. diff {relative:.3g} > {rtol}"
            problems.append(f"{metric} @ {iteration}: expected {want!r}, got {got!r} ({bound})")
    return problems


def golden_mismatch_message(case, problems):
    """What a failing golden-value comparison reports: each difference, then how to record new values."""
    return (f"{case.name} differs from {case.golden_path}:\n" + "\n".join(problems) + "\nIf the change is intended, "
            f"re-record the golden values with: python -m tests.functional_tests.regenerate_golden {case.name} "
            "(and review the diff)")


def compare_with_golden(case, metrics, golden):
    problems = []
    for metric in case.metrics:
        rtol = RELATIVE_TOLERANCE.get(metric, 1e-5)
        if rtol is None:
            continue
        if metric not in golden:
            problems.append(f"{metric}: not in {case.golden_path.name}; regenerate the golden values")
            continue
        spec = golden[metric]
        expected = {
            int(step): value
            for step, value in spec["values"].items()
            if (int(step) - spec["start_step"]) % spec["step_interval"] == 0
        }
        problems += compare_series(metric, expected, metrics.get(metric, {}), rtol, ABSOLUTE_TOLERANCE.get(metric, 0.0))
    return problems
