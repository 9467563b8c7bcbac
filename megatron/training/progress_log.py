"""--log-progress: a human-readable record of the job in `<--save>/progress.txt`, as upstream keeps it, so that a
series of jobs resuming one run leaves one file saying how far each got.

Rank 0 appends one tab-separated line per event, after a barrier (every rank calls these functions):

    2025-01-31 12:00:00<TAB>Job ID: 1234<TAB># GPUs: 8<TAB>Starting job<TAB>Iteration: 0<TAB>...

`Job ID` is $SLURM_JOB_ID (empty outside SLURM), `# GPUs` the number of ranks (upstream's label, CPU ranks
included). Events: `Starting job` (after a checkpoint is loaded), `Saved checkpoint` (after each save) and
`Exiting job` (when training stops). Each event line ends with the progress so far:
`Iteration`, `Consumed samples`, `Tokens (in billions)` (consumed samples x --seq-length), `Floating-point
operations` (the matmul estimate of --log-throughput, `training_flops_per_iteration`, over all consumed
samples, hence continuous across resumes) and, after the start, `Job throughput` (this job's floating-point
operations per second per rank, in TFLOP/s/GPU) and `Cumulative throughput` (the same since the first `Starting
job` of the latest series of jobs with this number of ranks, as upstream: the file's last lines with this
`# GPUs`, read back from progress.txt).
"""

import datetime
import os
import time

import torch.distributed as dist

FILE_NAME = "progress.txt"
TIME_FORMAT = "%Y-%m-%d %H:%M:%S"

# The job's start: (wall-clock seconds, consumed samples) when `start_progress_log` ran; None when off.
_JOB_START = None


def progress_log_path(args):
    return os.path.join(args.save, FILE_NAME)


def floating_point_operations(args, samples):
    """Estimated training FLOPs of `samples` samples (linear in the batch size, so any batch schedule sums)."""
    from megatron.training.training_log import training_flops_per_iteration

    return training_flops_per_iteration(args, samples)


def _progress_fields(args, iteration):
    samples = args.consumed_train_samples
    fields = [
        f"Iteration: {iteration}",
        f"Consumed samples: {samples}",
        f"Tokens (in billions): {samples * args.seq_length / 1e9:.9f}",
        f"Floating-point operations: {floating_point_operations(args, samples):.6e}",
    ]
    if _JOB_START is not None:
        start_time, start_samples = _JOB_START
        elapsed_s = max(time.time() - start_time, 1e-9)
        job_flops = floating_point_operations(args, samples - start_samples)
        fields.append(f"Job throughput: {job_flops / elapsed_s / args.world_size / 1e12:.6f} TFLOP/s/GPU")
        series_start = _series_start(progress_log_path(args), args.world_size)
        if series_start is not None:
            series_time, series_flops = series_start
            series_s = max(time.time() - series_time, 1e-9)
            series_flops = floating_point_operations(args, samples) - series_flops
            fields.append(f"Cumulative throughput: {series_flops / series_s / args.world_size / 1e12:.6f} TFLOP/s/GPU")
    return fields


def _series_start(path, world_size):
    """(seconds since the epoch, floating-point operations) of the first `Starting job` among the last lines of
    `path` written with `world_size` ranks; None when there is none."""
    if not os.path.exists(path):
        return None
    with open(path) as stream:
        lines = [line.rstrip("\n").split("\t") for line in stream if line.strip()]
    start = None
    for fields in reversed(lines):
        if len(fields) < 4 or fields[2] != f"# GPUs: {world_size}":
            break
        if fields[3] == "Starting job":
            start = fields
    if start is None:
        return None
    values = dict(field.split(": ", 1) for field in start[4:] if ": " in field)
    stamp = datetime.datetime.strptime(start[0], TIME_FORMAT).timestamp()
    return stamp, float(values["Floating-point operations"])


def _append(args, event, iteration):
    dist.barrier()
    if dist.get_rank() == 0:
        stamp = datetime.datetime.now().strftime(TIME_FORMAT)
        job_id = os.environ.get("SLURM_JOB_ID", "")
        fields = [stamp, f"Job ID: {job_id}", f"# GPUs: {args.world_size}", event] + _progress_fields(args, iteration)
        os.makedirs(args.save, exist_ok=True)
        with open(progress_log_path(args), "a") as stream:
            stream.write("\t".join(fields) + "\n")


def start_progress_log(args):
    """`Starting job` at `args.iteration` (after any checkpoint load); a no-op without --log-progress."""
    global _JOB_START
    if not getattr(args, "log_progress", False):
        return
    _JOB_START = None
    _append(args, "Starting job", args.iteration)
    _JOB_START = (time.time(), args.consumed_train_samples)


def log_checkpoint_saved(args, iteration):
    if _JOB_START is not None:
        _append(args, "Saved checkpoint", iteration)


def stop_progress_log(args, iteration):
    """`Exiting job` when training returns (collective; not after an error, where ranks may not meet)."""
    if _JOB_START is not None:
        _append(args, "Exiting job", iteration)
    forget_progress_log()


def forget_progress_log():
    global _JOB_START
    _JOB_START = None
