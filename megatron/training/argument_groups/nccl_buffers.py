"""NCCL user-buffer flags (upstream's names): Megatron-FSDP's buffers come from a memory pool registered with
NCCL, so collectives run on them in place with fewer SMs (`megatron_fsdp.nccl_allocator`). They need NCCL on
GPUs: under gloo (the CPU) they stop at validation with a message saying so and what to drop. Under NCCL the
dependencies between them are checked and they reach `DistributedDataParallelConfig` (`ddp_config_kwargs`).
`--use-nccl-ub` applies to Megatron-FSDP's buffers only (Megatron DDP's buffers are not pooled): it needs
`--use-megatron-fsdp`. The double-buffer flags act on Megatron-FSDP's double-buffer pool (`--fsdp-double-buffer`):
the pool is always sized by the largest unit up front, so `--megatron-fsdp-max-pool-double-buffer` asks for what
`--fsdp-double-buffer` does; `--fsdp-db-use-persist-buf-on-alloc-fail` gives each group a buffer of its own when the
pool does not fit in memory.
"""

# dest -> (flag, help)
NCCL_BUFFER_FLAGS = {
    "use_nccl_ub": ("--use-nccl-ub", "Allocate Megatron-FSDP's buffers from a memory pool (NCCL's allocator where "
                    "supported) registered with NCCL (user buffers), so collectives need fewer SMs."),
    "fsdp_manual_registration": ("--fsdp-manual-registration", "Register Megatron-FSDP's buffer pool with NCCL "
                                 "once, after every buffer exists, instead of after each allocation (needs "
                                 "--use-nccl-ub)."),
    "disable_symmetric_registration": ("--disable-symmetric-registration", "Register NCCL user buffers locally "
                                       "(ncclCommRegister), not as symmetric windows (needs --use-nccl-ub)."),
    "megatron_fsdp_max_pool_double_buffer": ("--megatron-fsdp-max-pool-double-buffer", "Size Megatron-FSDP's double "
                                             "buffer pool by its largest unit up front (needs --fsdp-double-buffer)."),
    "fsdp_db_use_persist_buf_on_alloc_fail": ("--fsdp-db-use-persist-buf-on-alloc-fail", "Fall back to persistent "
                                              "buffers when a double-buffer allocation fails (needs "
                                              "--fsdp-double-buffer)."),
}


def add_arguments(parser):
    group = parser.add_argument_group("NCCL user buffers")
    for flag, help_text in NCCL_BUFFER_FLAGS.values():
        group.add_argument(flag, action="store_true", help=help_text)


def _backend(args):
    from megatron.training import accelerator

    return args.distributed_backend or accelerator.default_backend()


def validate(args):
    given = [flag for dest, (flag, _) in NCCL_BUFFER_FLAGS.items() if getattr(args, dest)]
    if not given:
        return
    if _backend(args) != "nccl":
        flags = " ".join(given)
        raise ValueError(
            f"{flags}: NCCL user buffers need NCCL on GPUs (--distributed-backend nccl); this run uses "
            f"{_backend(args)}: drop {flags}"
        )
    for dest in ("fsdp_manual_registration", "disable_symmetric_registration"):
        if getattr(args, dest) and not args.use_nccl_ub:
            raise ValueError(f"{NCCL_BUFFER_FLAGS[dest][0]} needs --use-nccl-ub")
    if args.use_nccl_ub and not args.use_megatron_fsdp:
        raise ValueError("--use-nccl-ub registers Megatron-FSDP's buffers with NCCL: add --use-megatron-fsdp (Megatron "
                         "DDP's buffers are not allocated from NCCL's pool), or drop --use-nccl-ub")
    for dest in ("megatron_fsdp_max_pool_double_buffer", "fsdp_db_use_persist_buf_on_alloc_fail"):
        if getattr(args, dest) and not args.fsdp_double_buffer:
            raise ValueError(f"{NCCL_BUFFER_FLAGS[dest][0]} needs --fsdp-double-buffer (with --use-megatron-fsdp)")


def ddp_config_kwargs(args):
    """The DistributedDataParallelConfig fields of these flags (Megatron-FSDP runs only)."""
    return dict(
        nccl_ub=args.use_nccl_ub,
        fsdp_manual_registration=args.fsdp_manual_registration,
        disable_symmetric_registration=args.disable_symmetric_registration,
        fsdp_db_use_persist_buf_on_alloc_fail=args.fsdp_db_use_persist_buf_on_alloc_fail,
    )
