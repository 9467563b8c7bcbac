"""Communication and performance switches of upstream launch scripts: pipeline p2p, tensor-parallel overlap,
deferred weight gradients, CUDA graphs, RNG trackers, the rank order, NCCL-only process-group options and
the symmetric-memory all-reduce.

Each flag is accepted where this build does what it asks, or where it only changes when communication or a
computation happens and never a value (its help says what runs here instead); otherwise validation stops with
what to do. Nothing is ignored that would change the model, the numbers or the process groups a user gets.
"""

from megatron.core.rank_layout import DEFAULT_ORDER, TP_PP_DP_ORDER

# Upstream's --symmetric-ar-type choices (its default None: NCCL's ordinary all-reduce).
SYMMETRIC_ALL_REDUCE_TYPES = ("two_shot", "one_shot", "multimem_all_reduce")


def add_arguments(parser):
    group = parser.add_argument_group("communication and performance switches")
    _add_pipeline_arguments(group)
    _add_gpu_only_arguments(group)
    _add_process_group_arguments(group)


def _add_pipeline_arguments(group):
    group.add_argument("--overlap-p2p-communication", action="store_true", dest="overlap_p2p_comm", default=True,
                       help="Accepted for upstream scripts: upstream's default, overlapping an interleaved pipeline's "
                       "transfers with compute. Here the interleaved schedule posts each step's sends and receives "
                       "together, waits for the receives only and completes the sends later, with or without this "
                       "flag: it changes no value. Off without an interleaved pipeline, as upstream.")
    group.add_argument("--no-overlap-p2p-communication", action="store_false", dest="overlap_p2p_comm",
                       help="Accepted for upstream scripts: the same schedule runs as with "
                       "--overlap-p2p-communication (see there).")
    group.add_argument("--overlap-p2p-communication-warmup-flush", action="store_true",
                       dest="overlap_p2p_comm_warmup_flush", default=False,
                       help="Accepted for upstream scripts: upstream also overlaps the interleaved pipeline's "
                       "transfers with compute in the warm-up and the flush. Here every phase of the interleaved "
                       "schedule posts its sends and receives together (see --overlap-p2p-communication): it "
                       "changes no value. Off without an interleaved pipeline, as upstream.")
    group.add_argument("--no-overlap-p2p-communication-warmup-flush", action="store_false",
                       dest="overlap_p2p_comm_warmup_flush",
                       help="Accepted for upstream scripts: the same schedule runs (see "
                       "--overlap-p2p-communication-warmup-flush).")
    group.add_argument("--use-ring-exchange-p2p", action="store_true",
                       help="Upstream: torch.distributed.ring_exchange (a custom PyTorch build). Not supported: an "
                       "error.")
    group.add_argument("--variable-seq-lengths", action="store_true",
                       help="Sequence lengths may differ between microbatches: pipeline stages exchange each "
                       "activation's shape before it (one small extra transfer per exchange).")
    for name, what in (("grad-reduce", "gradient reductions"), ("param-gather", "parameter all-gathers")):
        dest = "align_" + name.replace("-", "_")
        group.add_argument(f"--align-{name}", action="store_true", dest=dest, default=True,
                           help=f"Accepted for upstream scripts: upstream's default, every pipeline stage launching "
                           f"its {what} at the same point of the schedule. Here each model chunk launches them when "
                           f"its own work allows (upstream's --no-align-{name}); both give the same values.")
        group.add_argument(f"--no-align-{name}", action="store_false", dest=dest,
                           help=f"Accepted for upstream scripts: each pipeline stage launches its {what} "
                           "independently, which is what this build always does.")
    group.add_argument("--defer-embedding-wgrad-compute", action="store_true",
                       help="Accepted for upstream scripts: upstream computes the output layer's weight gradient at "
                       "the pipeline flush; here it is computed in the output layer's backward (the same values).")
    group.add_argument("--wgrad-deferral-limit", type=int, default=0,
                       help="Accepted for upstream scripts: with --defer-embedding-wgrad-compute, the microbatches "
                       "upstream defers (0: all); nothing is deferred here.")
    group.add_argument("--delay-wgrad-compute", action="store_true",
                       help="Upstream: split weight-gradient GEMMs out of the backward (Transformer Engine). Not "
                       "supported: an error.")


def _add_gpu_only_arguments(group):
    group.add_argument("--tp-comm-overlap", action="store_true",
                       help="Upstream: overlap tensor-parallel communication with GEMMs through Transformer "
                       "Engine's userbuffers (CUDA). Not supported by this build: an error.")
    group.add_argument("--tp-comm-overlap-cfg", default=None, help="YAML of the userbuffers of --tp-comm-overlap.")
    group.add_argument("--tp-comm-bootstrap-backend", choices=["nccl", "mpi", "gloo"], default=None,
                       help="How --tp-comm-overlap's userbuffers are set up.")
    group.add_argument("--enable-cuda-graph", action="store_true",
                       help="Upstream: capture the layers in CUDA graphs. Not supported by this build: an error.")
    group.add_argument("--external-cuda-graph", action="store_true",
                       help="Upstream: CUDA graphs captured by the training loop. Not supported: an error.")
    group.add_argument("--cuda-graph-impl", choices=["none", "local", "transformer_engine"], default="none",
                       help="Only none: this build captures no CUDA graphs.")
    group.add_argument("--cuda-graph-scope", nargs="+", default=None, help="What CUDA graphs capture (upstream).")
    group.add_argument("--cuda-graph-warmup-steps", type=int, default=None,
                       help="Iterations before CUDA-graph capture (upstream).")
    group.add_argument("--te-rng-tracker", action="store_true",
                       help="Upstream: Transformer Engine's RNG tracker. Not supported: an error.")
    group.add_argument("--inference-rng-tracker", action="store_true",
                       help="Upstream: the RNG tracker configured for inference. Not supported: an error.")


def _add_process_group_arguments(group):
    group.add_argument("--use-tp-pp-dp-mapping", action="store_true",
                       help=f"Upstream: global ranks in the order {TP_PP_DP_ORDER} instead of {DEFAULT_ORDER}. The "
                       "layout exists here (initialize_model_parallel(order=...)) but the launcher does not take it "
                       "yet: an error.")
    group.add_argument("--disable-gloo-process-groups", action="store_true",
                       help="Upstream: create no gloo copies of the data-parallel groups. Not supported: an error.")
    group.add_argument("--high-priority-stream-groups", nargs="*", default=None,
                       help="Upstream (NCCL): process groups whose communicators get high-priority streams. Not "
                       "supported: an error.")
    group.add_argument("--nccl-communicator-config-path", default=None,
                       help="Upstream (NCCL): YAML of per-group NCCL communicator settings. Not supported: an error.")
    group.add_argument("--sharp", action="store_true",
                       help="Upstream (NCCL): SHARP in-network reductions for the data-parallel groups. Not "
                       "supported: an error.")
    group.add_argument("--symmetric-ar-type", default=None, choices=list(SYMMETRIC_ALL_REDUCE_TYPES),
                       help="Upstream (NCCL, GPUs): the symmetric-memory kernel of the tensor-parallel all-reduces "
                       "(Transformer Engine's row-parallel linears). Not supported: an error.")


def transformer_config_kwargs(args):
    return dict(variable_seq_lengths=args.variable_seq_lengths)


def validate(args):
    interleaved = (getattr(args, "virtual_pipeline_model_parallel_size", None) or 1) > 1
    if not interleaved:
        # Upstream: only the interleaved schedule overlaps p2p or aligns the parameter all-gathers.
        args.overlap_p2p_comm = False
        args.overlap_p2p_comm_warmup_flush = False
        args.align_param_gather = False
    _validate_pipeline(args)
    _validate_gpu_only(args)
    _validate_process_groups(args)


def _validate_pipeline(args):
    if args.use_ring_exchange_p2p:
        raise ValueError("--use-ring-exchange-p2p needs torch.distributed.ring_exchange (a custom PyTorch build); "
                         "pipeline stages here exchange with batch_isend_irecv: drop the flag")
    if args.wgrad_deferral_limit < 0:
        raise ValueError(f"--wgrad-deferral-limit must be >= 0, got {args.wgrad_deferral_limit}")
    if args.wgrad_deferral_limit and not args.defer_embedding_wgrad_compute:
        raise ValueError("--wgrad-deferral-limit needs --defer-embedding-wgrad-compute; drop it")
    if args.delay_wgrad_compute:
        raise ValueError("--delay-wgrad-compute needs Transformer Engine's split weight-gradient GEMMs (CUDA), "
                         "which this build does not use: weight gradients are computed inside each backward; drop "
                         "the flag (the values are the same)")


def _validate_gpu_only(args):
    if args.tp_comm_overlap:
        raise ValueError(f"--tp-comm-overlap {_tp_comm_overlap_reason()}: drop the flag; tensor-parallel "
                         "communication then runs between the GEMMs (same values)")
    for flag, given in (("--tp-comm-overlap-cfg", args.tp_comm_overlap_cfg is not None),
                        ("--tp-comm-bootstrap-backend", args.tp_comm_bootstrap_backend is not None)):
        if given:
            raise ValueError(f"{flag} configures --tp-comm-overlap, which this build does not support: drop it")
    cuda_graph_flags = (("--enable-cuda-graph", args.enable_cuda_graph),
                        ("--external-cuda-graph", args.external_cuda_graph),
                        (f"--cuda-graph-impl {args.cuda_graph_impl}", args.cuda_graph_impl != "none"),
                        ("--cuda-graph-scope", args.cuda_graph_scope is not None),
                        ("--cuda-graph-warmup-steps", args.cuda_graph_warmup_steps is not None))
    for flag, given in cuda_graph_flags:
        if given:
            raise ValueError(f"{flag}: CUDA graphs are not supported by this build; drop the flag (the layers run "
                             "eagerly)")
    if args.te_rng_tracker:
        raise ValueError("--te-rng-tracker asks for Transformer Engine's RNG tracker (upstream needs it for CUDA "
                         "graphs); this build's model-parallel RNG tracker (megatron.core.tensor_parallel.random) "
                         "gives every rank its dropout stream: drop the flag")
    if args.inference_rng_tracker:
        raise ValueError("--inference-rng-tracker configures the RNG tracker for inference; training here always "
                         "uses the model-parallel RNG tracker: drop the flag")


def _tp_comm_overlap_reason():
    from megatron.core.optional_deps import HAVE_TE
    from megatron.training.accelerator import cuda_available

    if HAVE_TE and cuda_available():
        return "needs Transformer Engine's userbuffers, which this build does not set up yet"
    return ("needs Transformer Engine's userbuffers on CUDA GPUs (transformer-engine is "
            f"{'importable' if HAVE_TE else 'not importable'} and CUDA is "
            f"{'available' if cuda_available() else 'not available'} here)")


def _validate_process_groups(args):
    args.rank_order = TP_PP_DP_ORDER if args.use_tp_pp_dp_mapping else DEFAULT_ORDER
    if args.use_tp_pp_dp_mapping:
        if args.context_parallel_size > 1 or getattr(args, "expert_model_parallel_size", 1) > 1:
            raise ValueError("--use-tp-pp-dp-mapping cannot be used with --context-parallel-size > 1 or "
                             "--expert-model-parallel-size > 1 (upstream's rule); drop it")
    backend = args.distributed_backend or _default_backend()
    _reject_symmetric_all_reduce(args, backend)
    nccl_options = (("--disable-gloo-process-groups", args.disable_gloo_process_groups),
                    ("--high-priority-stream-groups", args.high_priority_stream_groups is not None),
                    ("--nccl-communicator-config-path", args.nccl_communicator_config_path is not None),
                    ("--sharp", args.sharp))
    for flag, given in nccl_options:
        if not given:
            continue
        if backend != "nccl":
            if flag == "--disable-gloo-process-groups":
                raise ValueError(f"--disable-gloo-process-groups: this run's --distributed-backend is {backend}, so "
                                 "every process group is a gloo group; drop the flag")
            raise ValueError(f"{flag} is an NCCL option and this run's --distributed-backend is {backend}: drop it")
        raise ValueError(f"{flag} is not supported by this build yet (process groups are created with NCCL's "
                         "defaults, plus gloo copies of the data-parallel groups): drop it")


def _reject_symmetric_all_reduce(args, backend):
    if args.symmetric_ar_type is None:
        return
    flag = f"--symmetric-ar-type {args.symmetric_ar_type}"
    if backend != "nccl":
        raise ValueError(f"{flag} runs the tensor-parallel all-reduces on NCCL symmetric memory, which needs CUDA "
                         f"GPUs; this run's --distributed-backend is {backend}: drop the flag (tensor-parallel "
                         "all-reduces run as torch.distributed all_reduce, with the same values)")
    raise ValueError(f"{flag}: upstream hands it to Transformer Engine's row-parallel linears, which this build does "
                     "not use; its tensor-parallel all-reduces are torch.distributed all_reduce calls on the NCCL "
                     "group, with no symmetric-memory kernel: drop the flag (NCCL chooses its own algorithm; the "
                     "values are the same)")


def _default_backend():
    from megatron.training.accelerator import default_backend

    return default_backend()
