"""The torch format's distributed-optimizer files: each data-parallel rank's `distrib_optim_dp_rank_*.pt` holds
the optimizer state of the elements its gradient buffers give it, so it loads only where the buffers are cut the
same way: the same data-parallel size, the same number of optimizer instances and the same bucketing."""

# (flag, args attribute, default): besides the data-parallel size, what decides which elements a rank's shard holds.
SHARD_LAYOUT_FLAGS = (
    ("--num-distributed-optimizer-instances", "num_distributed_optimizer_instances", 1),
    ("--ddp-bucket-size", "ddp_bucket_size", None),
    ("--ddp-num-buckets", "ddp_num_buckets", None),
    ("--ddp-pad-buckets-for-high-nccl-busbw", "ddp_pad_buckets_for_high_nccl_busbw", False),
    ("--overlap-grad-reduce", "overlap_grad_reduce", False),  # sets the default bucket size
)

RESHARD_HINT = ("The torch format keeps the distributed optimizer's state as each data-parallel rank's shard: "
                "launch at the data-parallel size it was saved at, or with --no-load-optim to load the weights "
                "alone, or convert it to torch_dist (tools/checkpoint/convert_legacy.py), which loads at any "
                "data-parallel size")


def _shown(value):
    if value is True:
        return "set"
    if value is False:
        return "not set"
    return "not given" if value is None else str(value)


def shard_layout_changes(saved_args, args):
    """'--flag: S in the checkpoint, C in this run' for each flag of SHARD_LAYOUT_FLAGS whose values differ (flags
    the saved arguments lack are taken at their defaults)."""
    changes = []
    for flag, name, default in SHARD_LAYOUT_FLAGS:
        saved, current = getattr(saved_args, name, default), getattr(args, name, default)
        if saved != current:
            changes.append(f"{flag}: {_shown(saved)} in the checkpoint, {_shown(current)} in this run")
    return changes


def reshard_hint(saved_args, args):
    """What to do when a rank's shard file does not fit this run's shard: the flags that cut the shards
    otherwise, when some differ from the checkpoint's (launch with the checkpoint's values), then RESHARD_HINT."""
    changes = shard_layout_changes(saved_args, args)
    if not changes:
        return RESHARD_HINT
    return (f"The shards are cut otherwise because of {'; '.join(changes)}: launch with the checkpoint's value"
            f"{'s' if len(changes) > 1 else ''}. {RESHARD_HINT}")
