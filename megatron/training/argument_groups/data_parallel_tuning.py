"""Data-parallel and distributed-checkpoint tuning flags of upstream's FSDP recipes and test configurations:
gradient buckets by count (--ddp-num-buckets), Megatron-FSDP's communication unit
(--suggested-communication-unit-size), non-strict fsdp_dtensor loads (--disable-strict-fsdp-dtensor-load) and
the reshardable optimizer checkpoint (--dist-ckpt-optim-fully-reshardable, and its memory-saving mode
--distrib-optim-fully-reshardable-mem-efficient, which nothing here needs). The two Megatron-FSDP switches
this build does not implement (--create-all-gather-group, --megatron-fsdp-enable-fine-grained-param-gather)
and the distributed optimizer's --overlap-param-gather-with-optimizer-step stop at validation with what to do
instead. --ddp-pad-buckets-for-high-nccl-busbw pads Megatron DDP's gradient buckets."""

import warnings

LOGICAL_FORMATS = ("torch_dist", "torch_dcp", "fsdp_dtensor")
DEFAULT_STRICTNESS = "assume_ok_unexpected"
NON_STRICT_FSDP_DTENSOR_STRICTNESS = "log_all"


def add_arguments(parser):
    group = parser.add_argument_group("data-parallel tuning")
    group.add_argument("--ddp-num-buckets", type=int, default=None,
                       help="Split the data-parallel gradients into about this many buckets: the bucket size is the "
                       "model chunks' parameter count // N (exclusive with --ddp-bucket-size).")
    group.add_argument("--ddp-pad-buckets-for-high-nccl-busbw", action="store_true",
                       help="Pad each DDP gradient bucket to a multiple of lcm(data-parallel size, 128) x 2^16 "
                       "elements instead of the data-parallel size, so NCCL's per-rank message sizes are large "
                       "powers of two (higher bus bandwidth at large data-parallel sizes; more padding memory).")
    group.add_argument("--suggested-communication-unit-size", type=int, default=None,
                       help="Megatron-FSDP: elements per communication group for the parameters outside the "
                       "transformer-layer units (their bucket size; exclusive with --ddp-bucket-size).")
    group.add_argument("--create-all-gather-group", action="store_true",
                       help="Upstream: a separate process group for Megatron-FSDP's all-gathers. Not implemented "
                       "here (all-gathers already run on their own stream): an error.")
    group.add_argument("--megatron-fsdp-enable-fine-grained-param-gather", action="store_true",
                       help="Upstream Megatron-FSDP's fine-grained parameter gather. Not implemented here: an error.")
    group.add_argument("--overlap-param-gather-with-optimizer-step", action="store_true",
                       help="Upstream: start the first model chunk's parameter all-gather inside the optimizer step "
                       "(distributed optimizer, --overlap-param-gather, interleaved pipeline). Not implemented here "
                       "(--overlap-param-gather already overlaps it with the next forward): an error.")
    group.add_argument("--disable-strict-fsdp-dtensor-load", action="store_true",
                       help="--ckpt-format fsdp_dtensor loads tolerate keys missing from the checkpoint (those "
                       "tensors keep their values) and unexpected ones, both listed: --dist-ckpt-strictness log_all.")
    group.add_argument("--dist-ckpt-optim-fully-reshardable", action="store_true",
                       help="Save optimizer state so that TP/PP/DP may all change on load. The torch_dist / "
                       "fsdp_dtensor optimizer state here is always keyed per whole parameter, so it is always "
                       "fully reshardable; the flag needs such a --ckpt-format.")
    group.add_argument("--distrib-optim-fully-reshardable-mem-efficient", action="store_true",
                       help="Upstream: save and load the fully reshardable distributed-optimizer state with as "
                       "little memory as possible (gathered through one rank over gloo). Changes nothing here: "
                       "each rank writes and reads only its own shard of the torch_dist optimizer state, so "
                       "nothing is gathered. Has effect upstream only with --dist-ckpt-optim-fully-reshardable "
                       "(a warning without it).")


def validate(args):
    if args.ddp_pad_buckets_for_high_nccl_busbw and (args.use_megatron_fsdp or args.use_torch_fsdp2):
        wrapper = "--use-megatron-fsdp" if args.use_megatron_fsdp else "--use-torch-fsdp2"
        warnings.warn(f"--ddp-pad-buckets-for-high-nccl-busbw pads the buckets of Megatron DDP; {wrapper} has its "
                      "own buffers, which it does not change")
    if args.ddp_num_buckets is not None:
        if args.ddp_bucket_size is not None:
            raise ValueError("--ddp-num-buckets and --ddp-bucket-size are exclusive: pick one")
        if args.ddp_num_buckets <= 0:
            raise ValueError(f"--ddp-num-buckets must be positive, got {args.ddp_num_buckets}")
        if args.use_torch_fsdp2:
            raise ValueError("--ddp-num-buckets sizes the gradient buckets of Megatron DDP and Megatron-FSDP; "
                             "--use-torch-fsdp2 communicates per fully_shard module and has none: drop it")
    unit = args.suggested_communication_unit_size
    if unit is not None:
        if not args.use_megatron_fsdp:
            raise ValueError("--suggested-communication-unit-size needs --use-megatron-fsdp")
        if unit <= 0:
            raise ValueError(f"--suggested-communication-unit-size must be positive, got {unit}")
        if args.ddp_bucket_size is not None or args.ddp_num_buckets is not None:
            raise ValueError("--suggested-communication-unit-size sets Megatron-FSDP's bucket size: drop "
                             "--ddp-bucket-size / --ddp-num-buckets")
        args.ddp_bucket_size = unit
    if args.create_all_gather_group:
        raise ValueError("--create-all-gather-group is not implemented: Megatron-FSDP here issues its all-gathers "
                         "on the data-parallel group from their own stream; drop the flag")
    if args.megatron_fsdp_enable_fine_grained_param_gather:
        raise ValueError("--megatron-fsdp-enable-fine-grained-param-gather is not implemented: Megatron-FSDP here "
                         "gathers the parameters of one transformer-layer unit at a time; drop the flag")
    if args.overlap_param_gather_with_optimizer_step:
        _refuse_overlap_param_gather_with_optimizer_step(args)
    if args.disable_strict_fsdp_dtensor_load:
        if args.ckpt_format != "fsdp_dtensor":
            raise ValueError("--disable-strict-fsdp-dtensor-load needs --ckpt-format fsdp_dtensor; for other "
                             "formats use --dist-ckpt-strictness")
        if args.dist_ckpt_strictness not in (DEFAULT_STRICTNESS, NON_STRICT_FSDP_DTENSOR_STRICTNESS):
            raise ValueError(f"--disable-strict-fsdp-dtensor-load means --dist-ckpt-strictness "
                             f"{NON_STRICT_FSDP_DTENSOR_STRICTNESS}; drop --dist-ckpt-strictness "
                             f"{args.dist_ckpt_strictness}")
        args.dist_ckpt_strictness = NON_STRICT_FSDP_DTENSOR_STRICTNESS
    if args.distrib_optim_fully_reshardable_mem_efficient and not args.dist_ckpt_optim_fully_reshardable:
        warnings.warn("--distrib-optim-fully-reshardable-mem-efficient has effect only with "
                      "--dist-ckpt-optim-fully-reshardable (as upstream); add that flag or drop this one")
    if args.dist_ckpt_optim_fully_reshardable and args.ckpt_format not in LOGICAL_FORMATS:
        raise ValueError(f"--dist-ckpt-optim-fully-reshardable needs --ckpt-format torch_dist (or "
                         f"{', '.join(LOGICAL_FORMATS[1:])}); --ckpt-format {args.ckpt_format} saves each rank's "
                         "optimizer state as it is")


def _refuse_overlap_param_gather_with_optimizer_step(args):
    """Upstream's rules first, so a launch script learns everything it got wrong; then the refusal."""
    flag = "--overlap-param-gather-with-optimizer-step"
    if not args.use_distributed_optimizer:
        raise ValueError(f"{flag} needs --use-distributed-optimizer")
    if not args.overlap_param_gather:
        raise ValueError(f"{flag} needs --overlap-param-gather")
    if args.virtual_pipeline_model_parallel_size is None:
        raise ValueError(f"{flag} needs the interleaved pipeline (--num-layers-per-virtual-pipeline-stage or "
                         "--num-virtual-stages-per-pipeline-rank)")
    raise ValueError(f"{flag} is not implemented: under --overlap-param-gather the updated parameters' all-gather "
                     "already overlaps the next forward (each bucket is waited for just before its first use); "
                     "drop the flag")


def bucket_size_for(args, model_chunks):
    """The gradient bucket size in elements: --ddp-num-buckets as upstream (all chunks' parameters // N), else
    --ddp-bucket-size (None: the wrapper's default)."""
    if args.ddp_num_buckets is None:
        return args.ddp_bucket_size
    num_parameters = sum(param.numel() for chunk in model_chunks for param in chunk.parameters())
    return max(1, num_parameters // args.ddp_num_buckets)


def ddp_config_kwargs(args):
    return dict(pad_buckets_for_high_nccl_busbw=args.ddp_pad_buckets_for_high_nccl_busbw)
