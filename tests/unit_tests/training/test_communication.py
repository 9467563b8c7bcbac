"""Communication and performance switches (argument_groups/communication.py): the accepted ones parse and reach
the config or derived values as upstream; the others stop with a message naming the flag. The tp-pp-dp rank
order itself is laid out by rank_layout (group membership checked here)."""

from functools import partial

import pytest

from megatron.core import parallel_state
from megatron.training.model_config import core_transformer_config_from_args
from tests.unit_tests.training import argument_checks

FOUR_LAYERS_ON_GLOO = "--num-layers 4 --micro-batch-size 1 --distributed-backend gloo"
INTERLEAVED = "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 --global-batch-size 4"
validated = partial(argument_checks.validated, world_size=2, base=f"{argument_checks.BASE} {FOUR_LAYERS_ON_GLOO}")


def test_defaults_follow_upstream():
    args = validated("")
    assert args.align_grad_reduce and not args.variable_seq_lengths
    # Only the interleaved schedule overlaps p2p or aligns parameter gathers (upstream turns them off otherwise).
    assert not args.overlap_p2p_comm and not args.align_param_gather
    interleaved = validated(INTERLEAVED)
    assert interleaved.overlap_p2p_comm and interleaved.align_param_gather
    assert not validated(INTERLEAVED + " --no-overlap-p2p-communication --no-align-param-gather").overlap_p2p_comm
    assert not validated("--no-align-grad-reduce").align_grad_reduce


def test_warmup_flush_overlap_is_accepted_for_the_interleaved_schedule():
    assert not validated(INTERLEAVED).overlap_p2p_comm_warmup_flush
    assert validated(INTERLEAVED + " --overlap-p2p-communication-warmup-flush").overlap_p2p_comm_warmup_flush
    assert not validated(INTERLEAVED + " --no-overlap-p2p-communication-warmup-flush").overlap_p2p_comm_warmup_flush
    # Only the interleaved schedule overlaps anything (as --overlap-p2p-communication).
    plain = validated("--pipeline-model-parallel-size 2 --overlap-p2p-communication-warmup-flush")
    assert not plain.overlap_p2p_comm_warmup_flush


def test_accepted_switches():
    args = validated("--overlap-p2p-communication --align-grad-reduce --align-param-gather "
                     "--defer-embedding-wgrad-compute --wgrad-deferral-limit 2 --pipeline-model-parallel-size 2 "
                     "--variable-seq-lengths")
    assert core_transformer_config_from_args(args).variable_seq_lengths
    assert args.rank_order == parallel_state.DEFAULT_ORDER
    assert validated(INTERLEAVED + " --variable-seq-lengths").variable_seq_lengths  # as upstream


@pytest.mark.parametrize("extra, message", [
    ("--use-ring-exchange-p2p", "--use-ring-exchange-p2p needs torch.distributed.ring_exchange"),
    ("--wgrad-deferral-limit 2", "--wgrad-deferral-limit needs --defer-embedding-wgrad-compute"),
    ("--delay-wgrad-compute", "--delay-wgrad-compute needs Transformer Engine"),
    ("--tp-comm-overlap", "--tp-comm-overlap needs Transformer Engine's userbuffers"),
    ("--tp-comm-overlap-cfg ub.yaml", "--tp-comm-overlap-cfg configures --tp-comm-overlap"),
    ("--tp-comm-bootstrap-backend gloo", "--tp-comm-bootstrap-backend configures --tp-comm-overlap"),
    ("--enable-cuda-graph", "--enable-cuda-graph: CUDA graphs are not supported"),
    ("--external-cuda-graph", "--external-cuda-graph: CUDA graphs are not supported"),
    ("--cuda-graph-impl local", "--cuda-graph-impl local: CUDA graphs are not supported"),
    ("--cuda-graph-scope attn", "--cuda-graph-scope: CUDA graphs are not supported"),
    ("--te-rng-tracker", "--te-rng-tracker asks for Transformer Engine's RNG tracker"),
    ("--inference-rng-tracker", "--inference-rng-tracker configures the RNG tracker for inference"),
    ("--use-tp-pp-dp-mapping --context-parallel-size 2", "--use-tp-pp-dp-mapping cannot be used with"),
    ("--disable-gloo-process-groups", "--disable-gloo-process-groups: this run's --distributed-backend is gloo"),
    ("--high-priority-stream-groups dp", "--high-priority-stream-groups is an NCCL option"),
    ("--nccl-communicator-config-path nccl.yaml", "--nccl-communicator-config-path is an NCCL option"),
    ("--sharp", "--sharp is an NCCL option and this run's --distributed-backend is gloo"),
])
def test_stops_name_the_flag(extra, message):
    with pytest.raises(ValueError) as error:
        validated(extra)
    assert message in str(error.value)


def test_nccl_options_on_nccl_are_not_supported_yet():
    with pytest.raises(ValueError, match="--sharp is not supported by this build yet"):
        validated("--distributed-backend nccl --sharp")


def test_tp_pp_dp_order_groups():
    # 8 ranks, TP2 x PP2 x DP2: pipeline neighbours are consecutive TP groups, replicas are 4 ranks apart.
    groups = parallel_state.generate_rank_groups(8, tp=2, pp=2, order=parallel_state.TP_PP_DP_ORDER)
    assert groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["pp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups["mp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert groups["embedding"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    default = parallel_state.generate_rank_groups(8, tp=2, pp=2)
    assert default["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]] and default["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]


ACCEPTED_WITHOUT_EFFECT = ("--overlap-p2p-communication", "--no-overlap-p2p-communication", "--align-grad-reduce",
                           "--no-align-grad-reduce", "--align-param-gather", "--no-align-param-gather",
                           "--defer-embedding-wgrad-compute", "--wgrad-deferral-limit", "--moe-permute-fusion",
                           "--moe-router-fusion", "--moe-use-legacy-grouped-gemm", "--moe-deepep-num-sms")


def test_flags_accepted_without_effect_say_so():
    from megatron.training.arguments import build_parser

    helps = {flag: action.help for action in build_parser()._actions for flag in action.option_strings}
    for flag in ACCEPTED_WITHOUT_EFFECT:
        assert helps[flag].startswith("Accepted for upstream scripts: "), flag


def _losses_and_groups_under_orders(workdir):
    import torch

    from tests.unit_tests.dist_checkpointing.pretrain_helpers import run_pretrain

    results = {}
    for name, flags in (("default", ""), ("tp_pp_dp", "--use-tp-pp-dp-mapping")):
        for wrapper in ("", "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params"):
            losses = run_pretrain(f"{workdir}/{name}", f"--pipeline-model-parallel-size 2 {flags} {wrapper} "
                                  "--train-iters 4")
            groups = (torch.distributed.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group()),
                      torch.distributed.get_process_group_ranks(parallel_state.get_data_parallel_group()))
            results[(name, wrapper)] = (losses, groups)
    return results


@pytest.mark.parametrize("world_size", [4])
def test_tp_pp_dp_mapping_places_ranks_and_trains_as_the_default_order(tmp_path, world_size):
    from tests.unit_tests.multiprocess_harness import run_on_ranks

    per_rank = run_on_ranks(world_size, _losses_and_groups_under_orders, str(tmp_path))
    for rank, results in enumerate(per_rank):
        for (name, wrapper), (losses, (pipeline, data)) in results.items():
            if name == "default":  # tp-cp-ep-dp-pp: data-parallel neighbours are adjacent ranks
                assert (pipeline, data) == ([rank % 2, rank % 2 + 2], [rank // 2 * 2, rank // 2 * 2 + 1])
            else:  # tp-cp-ep-pp-dp: pipeline neighbours are adjacent ranks
                assert (pipeline, data) == ([rank // 2 * 2, rank // 2 * 2 + 1], [rank % 2, rank % 2 + 2])
            assert len(losses) == 4
            assert losses == results[("default", wrapper)][0], (wrapper, losses)  # the same sums: bit for bit
