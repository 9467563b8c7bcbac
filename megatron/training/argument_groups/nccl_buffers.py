"""NCCL user-buffer flags (upstream's names): registering data-parallel / Megatron-FSDP communication buffers
with NCCL so collectives use fewer SMs. They need NCCL on GPUs: under gloo (the CPU) they stop at validation
with a message saying so and what to drop. Under NCCL the dependencies between them are checked as upstream
does, and then they are rejected as not implemented yet (the buffers would come from torch's NCCL memory-pool
allocator, upstream's `nccl_allocator.py`): never silently ignored.
"""

# dest -> (flag, help)
NCCL_BUFFER_FLAGS = {
    "use_nccl_ub": ("--use-nccl-ub", "Allocate data-parallel / FSDP communication buffers from NCCL's memory pool "
                    "and register them (user buffers), so collectives need fewer SMs."),
    "fsdp_manual_registration": ("--fsdp-manual-registration", "Register Megatron-FSDP's buffers with NCCL "
                                 "manually, once, instead of at allocation (needs --use-nccl-ub)."),
    "disable_symmetric_registration": ("--disable-symmetric-registration", "Register NCCL user buffers without "
                                       "symmetric (window) registration (needs --use-nccl-ub)."),
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
    if args.fsdp_manual_registration and not args.use_megatron_fsdp:
        raise ValueError("--fsdp-manual-registration needs --use-megatron-fsdp")
    for dest in ("megatron_fsdp_max_pool_double_buffer", "fsdp_db_use_persist_buf_on_alloc_fail"):
        if getattr(args, dest) and not args.fsdp_double_buffer:
            raise ValueError(f"{NCCL_BUFFER_FLAGS[dest][0]} needs --fsdp-double-buffer (with --use-megatron-fsdp)")
    raise ValueError(f"not implemented yet: {given[0]}")
