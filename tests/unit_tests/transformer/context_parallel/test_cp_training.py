"""A GPT trained with context parallelism equals the same GPT without it: `pretrain()` on rank pools, losses of
every iteration to 1e-5 relative, for each comm type under each data-parallel wrapper, with RoPE and
grouped-query attention, and composed with tensor + sequence parallelism, pipeline and expert parallelism."""

import pytest
import torch
import torch.distributed as dist

from megatron.core.transformer.context_parallel import context_parallel_loss, local_rows
from tests.unit_tests.dist_checkpointing.pretrain_helpers import run_pretrain
from tests.unit_tests.multiprocess_harness import run_on_ranks

MODEL = "--position-embedding-type rope --group-query-attention --num-query-groups 2 --train-iters 4 --lr-decay-iters 4"
WRAPPERS = {
    "ddp": "",
    "distributed_optimizer": "--use-distributed-optimizer",
    "megatron_fsdp_z3": "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params",
    "fsdp2": "--use-torch-fsdp2",
}


def _cp_and_reference(workdir, reference_args, cp_args):
    return run_pretrain(workdir, f"{MODEL} {reference_args}"), run_pretrain(workdir, f"{MODEL} {cp_args}")


@pytest.fixture(scope="module")
def reference_losses(tmp_path_factory):
    """`losses(world_size, flags)`: {iteration: loss} of MODEL + `flags` without context parallelism, trained once
    per configuration for all the tests of this module that compare against it."""
    workdir, trained = str(tmp_path_factory.mktemp("cp_references")), {}

    def losses(world_size, flags):
        if (world_size, flags) not in trained:
            trained[world_size, flags] = run_on_ranks(world_size, run_pretrain, workdir, f"{MODEL} {flags}")[0]
        return trained[world_size, flags]

    return losses


def _with_cp(world_size, workdir, reference, cp_args):
    """(reference, losses with CP) per rank, for `_assert_same_losses`."""
    return [(reference, losses) for losses in run_on_ranks(world_size, run_pretrain, workdir, f"{MODEL} {cp_args}")]


def _assert_same_losses(results):
    for reference, with_cp in results:
        assert sorted(with_cp) == sorted(reference) == [1, 2, 3, 4]
        for iteration, loss in reference.items():
            assert abs(with_cp[iteration] - loss) <= 1e-5 * abs(loss), (iteration, loss, with_cp[iteration])


@pytest.mark.parametrize("world_size", [2])
@pytest.mark.parametrize(
    "comm_type, wrapper",
    [("p2p", "ddp"), ("allgather", "distributed_optimizer"), ("a2a", "megatron_fsdp_z3"), ("p2p", "fsdp2"),
     ("p2p", "megatron_fsdp_z3")],
)
def test_cp2_trains_as_cp1(tmp_path, world_size, comm_type, wrapper, reference_losses):
    """CP2 on two ranks (one data-parallel rank) against DP2 without context parallelism: the same global batch."""
    extra = WRAPPERS[wrapper]
    _assert_same_losses(_with_cp(world_size, str(tmp_path), reference_losses(world_size, extra),
                                 f"{extra} --context-parallel-size 2 --cp-comm-type {comm_type}"))


@pytest.mark.parametrize("world_size", [2])
def test_cp2_with_an_explicit_attention_mask_trains_as_cp1(tmp_path, world_size, reference_losses):
    """--reset-attention-mask makes the dataset hand out a `[b, 1, s, s]` mask: the explicit-mask path of the
    ring. (Mock samples hold no EOD, so the loss mask is full here; see the uneven-count test below.)"""
    masks = "--reset-attention-mask --reset-position-ids --eod-mask-loss"
    _assert_same_losses(_with_cp(world_size, str(tmp_path), reference_losses(world_size, masks),
                                 f"{masks} --context-parallel-size 2 --cp-comm-type p2p"))


@pytest.mark.parametrize("world_size", [4])
def test_cp2_tp2_sequence_parallel_trains_as_tp2(tmp_path, world_size):
    tp = "--tensor-model-parallel-size 2 --sequence-parallel --use-distributed-optimizer"
    results = run_on_ranks(world_size, _cp_and_reference, str(tmp_path), tp, f"{tp} --context-parallel-size 2")
    _assert_same_losses(results)


MOE = "--num-experts 4 --moe-router-topk 2 --moe-token-dispatcher-type alltoall --moe-aux-loss-coeff 0.01"
EP_WRAPPERS = ("ddp", "distributed_optimizer", "fsdp2")


def _moe_without_and_with_cp_and_ep(workdir):
    """DP2 (each rank all four experts) once, then CP2 x EP2 (each rank two experts) under each wrapper."""
    reference = run_pretrain(workdir, f"{MODEL} {MOE}")
    cp_ep = "--context-parallel-size 2 --expert-model-parallel-size 2"
    return [(reference, run_pretrain(workdir, f"{MODEL} {MOE} {WRAPPERS[wrapper]} {cp_ep}"))
            for wrapper in EP_WRAPPERS]


@pytest.mark.parametrize("world_size", [2])
def test_cp2_with_expert_parallel_moe_trains_as_dp2(tmp_path, world_size):
    """Context parallelism composed with expert parallelism: the experts' tokens come from both CP ranks' rows
    (the expert data-parallel group spans DP x CP / EP), aux losses included."""
    _assert_same_losses(run_on_ranks(world_size, _moe_without_and_with_cp_and_ep, str(tmp_path))[0])


def _loss_gradient_with_uneven_token_counts(per_token_loss):
    """Per-token losses as a leaf: each CP rank's gradient, averaged over CP as the data-parallel wrappers
    average over DP x CP, must be that of the mean over the whole sequence's unmasked tokens."""
    cp_size, cp_rank = dist.get_world_size(), dist.get_rank()
    generator = torch.Generator().manual_seed(3)
    losses = torch.rand(16, generator=generator)
    mask = torch.zeros(16)
    mask[:5] = 1.0  # rank 0 holds positions 0-3 and 12-15 (4 tokens counted), rank 1 holds 4-11 (1 token)
    full = losses.clone().requires_grad_()
    (torch.sum(full * mask) / mask.sum()).backward()
    local = local_rows(losses.view(1, -1), 1, cp_size, cp_rank).view(-1).clone().requires_grad_()
    local_mask = local_rows(mask.view(1, -1), 1, cp_size, cp_rank).view(-1)
    loss_sum, count = context_parallel_loss(torch.sum(local * local_mask), local_mask.sum(), dist.group.WORLD,
                                            per_token_loss)
    if per_token_loss:  # the schedule sums counts over DP x CP and divides the summed gradients once
        total = count.clone()
        dist.all_reduce(total)
        (loss_sum / total).backward()
        scale = 1.0
    else:  # the schedule divides by the returned count; the wrappers average gradients over DP x CP
        (loss_sum / count).backward()
        scale = 1.0 / cp_size
    expected = local_rows(full.grad.view(1, -1), 1, cp_size, cp_rank).view(-1)
    return (local.grad * scale - expected).abs().max().item(), local_mask.sum().item()


@pytest.mark.parametrize("world_size", [2])
@pytest.mark.parametrize("per_token_loss", [False, True])
def test_cp_loss_is_the_mean_over_the_whole_sequence(world_size, per_token_loss):
    results = run_on_ranks(world_size, _loss_gradient_with_uneven_token_counts, per_token_loss)
    assert [count for _, count in results] == [4.0, 1.0]
    assert all(error < 1e-7 for error, _ in results), results


@pytest.mark.parametrize("world_size", [4])
def test_cp2_pp2_trains_as_pp2(tmp_path, world_size):
    pp = "--pipeline-model-parallel-size 2"
    results = run_on_ranks(world_size, _cp_and_reference, str(tmp_path), pp,
                           f"{pp} --context-parallel-size 2 --cp-comm-type a2a")
    _assert_same_losses(results)


def _cp_checkpoint_resumed_without_cp(workdir):
    """CP2 Megatron-FSDP ZeRO-3 saving at iteration 2 (torch_dist), then CP1 DDP loading that checkpoint and
    training iterations 3 and 4."""
    schedule = "--train-iters 4 --lr-decay-iters 4 --ckpt-format torch_dist"
    checkpoint = f"{workdir}/cp2_fsdp_ckpt"
    first_half = run_pretrain(
        workdir, f"{MODEL} {schedule} {WRAPPERS['megatron_fsdp_z3']} --context-parallel-size 2 --cp-comm-type p2p "
                 f"--save {checkpoint} --save-interval 2 --exit-interval 2")
    resumed = run_pretrain(workdir, f"{MODEL} {schedule} --load {checkpoint}")
    return first_half, resumed


@pytest.mark.parametrize("world_size", [2])
def test_a_cp2_megatron_fsdp_checkpoint_resumes_under_cp1_ddp(tmp_path, world_size, reference_losses):
    """The checkpoint holds logical tensors (no trace of the CP layout or of the sharding): CP1 DDP resumes a CP2
    Megatron-FSDP run as if it had trained the first half itself (compared with 4 iterations of CP1 DDP)."""
    straight = reference_losses(world_size, WRAPPERS["ddp"])
    for first_half, resumed in run_on_ranks(world_size, _cp_checkpoint_resumed_without_cp, str(tmp_path)):
        assert sorted(first_half) == [1, 2] and sorted(resumed) == [3, 4]
        for iteration, losses in ((1, first_half), (2, first_half), (3, resumed), (4, resumed)):
            loss = straight[iteration]
            assert abs(losses[iteration] - loss) <= 1e-5 * abs(loss), (iteration, loss, losses[iteration])
