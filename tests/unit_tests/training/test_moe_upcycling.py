"""`--moe-use-upcycling` end to end on 2 gloo ranks: a dense GPT trained 2 iterations and saved is upcycled into 4
experts (top-2 softmax routing renormalises the two probabilities to sum 1, so identical experts compute the dense
MLP exactly), under Megatron DDP, under Megatron-FSDP ZeRO-3 with expert parallelism 2, at TP2 + SP with grouped
GEMM experts and at PP2. The upcycled run's first
loss is the dense model's loss of the same batch (the dense run resumed for one more iteration), its experts are
the dense MLPs bit for bit, and a second launch into the same --save, or one with another --num-layers, is
refused."""

import pytest
import torch

from tests.unit_tests.dist_checkpointing.pretrain_helpers import pretrain_records
from tests.unit_tests.multiprocess_harness import run_on_ranks

DENSE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
         "--swiglu --disable-bias-linear --untie-embeddings-and-output-weights --hidden-dropout 0 "
         "--attention-dropout 0 --micro-batch-size 2 --global-batch-size 8 --lr 5e-3 --lr-decay-iters 3 "
         "--train-iters 3 --seed 7 --mock-data --tokenizer-type NullTokenizer --vocab-size 120 "
         "--make-vocab-size-divisible-by 64 --num-workers 0 --log-interval 1 --eval-iters 0 "
         "--distributed-backend gloo --ckpt-format torch_dist")
MOE = "--num-experts 4 --moe-router-topk 2 --moe-router-load-balancing-type none --moe-use-upcycling"
FSDP_EP2 = "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params --expert-model-parallel-size 2"


def _losses(workdir, name, argv):
    return {record["iteration"]: record["lm loss"] for record in pretrain_records(f"{workdir}/{name}", argv)}


def _expert_and_dense_tensors(dense_root, moe_root):
    """{expert tensor name: (its tensor, the dense MLP tensor it copies)} of the checkpoints' iteration 2."""
    from megatron.core.dist_checkpointing import offline

    dense = offline.full_precision_model(offline.read_checkpoint(f"{dense_root}/iter_0000002"))
    moe = offline.full_precision_model(offline.read_checkpoint(f"{moe_root}/iter_0000002"))
    pairs = {}
    for layer in range(2):
        for expert in range(4):
            for fc in ("linear_fc1", "linear_fc2"):
                name = f"decoder.layers.{layer}.mlp.experts.local_experts.{expert}.{fc}.weight"
                pairs[name] = (moe[name], dense[f"decoder.layers.{layer}.mlp.{fc}.weight"])
    return pairs, moe["decoder.layers.0.mlp.router.weight"].shape


def _all_runs(workdir):
    from megatron.training.moe_upcycling import UpcyclingError

    dense_root = f"{workdir}/dense"
    losses = {"saved": _losses(workdir, "saved", f"{DENSE} --save {dense_root} --save-interval 2 --exit-interval 2")}
    losses["dense"] = _losses(workdir, "dense", f"{DENSE} --load {dense_root}")
    losses["ddp"] = _losses(workdir, "ddp", f"{DENSE} {MOE} --load {dense_root} --save {workdir}/moe_ddp")
    losses["fsdp_ep2"] = _losses(workdir, "fsdp_ep2", f"{DENSE} {MOE} {FSDP_EP2} --load {dense_root} "
                                                      f"--save {workdir}/moe_fsdp")
    losses["tp2_sp_grouped"] = _losses(workdir, "tp2", f"{DENSE} {MOE} --tensor-model-parallel-size 2 "
                                                      "--sequence-parallel --moe-grouped-gemm "
                                                      f"--load {dense_root} --save {workdir}/moe_tp2")
    losses["pp2"] = _losses(workdir, "pp2", f"{DENSE} {MOE} --pipeline-model-parallel-size 2 --load {dense_root} "
                                            f"--save {workdir}/moe_pp2")
    with pytest.raises(UpcyclingError) as refused:
        _losses(workdir, "again", f"{DENSE} {MOE} --load {dense_root} --save {workdir}/moe_ddp")
    with pytest.raises(UpcyclingError) as mismatched:
        _losses(workdir, "mismatched", f"{DENSE.replace('--num-layers 2', '--num-layers 3')} {MOE} "
                                       f"--load {dense_root} --save {workdir}/moe_mismatched")
    pairs = router_shape = None
    if torch.distributed.get_rank() == 0:
        pairs, router_shape = _expert_and_dense_tensors(dense_root, f"{workdir}/moe_ddp")
    return losses, (str(refused.value), str(mismatched.value)), pairs, router_shape


@pytest.mark.parametrize("world_size", [2])
def test_upcycled_moe_starts_from_the_dense_model(world_size, tmp_path):
    results = run_on_ranks(world_size, _all_runs, str(tmp_path))
    losses, (refusal, mismatch), pairs, router_shape = results[0]
    assert sorted(losses["saved"]) == [1, 2] and sorted(losses["dense"]) == [3]
    dense = losses["dense"][3]
    for run in ("ddp", "fsdp_ep2"):
        assert sorted(losses[run]) == [3], run  # resumed at the dense checkpoint's iteration and samples
        assert losses[run][3] == pytest.approx(dense, rel=1e-6), run
    # The upcycled checkpoint is written whole, so other layouts load it: tensor parallelism with sequence
    # parallelism and grouped GEMM experts sums partial products over 2 ranks (1e-5), pipeline stages do not.
    assert sorted(losses["tp2_sp_grouped"]) == [3] and sorted(losses["pp2"]) == [3]
    assert losses["tp2_sp_grouped"][3] == pytest.approx(dense, rel=1e-5)
    assert losses["pp2"][3] == pytest.approx(dense, rel=1e-6)
    assert len(pairs) == 16 and router_shape == (4, 32)
    for name, (expert, dense_mlp) in pairs.items():
        assert torch.equal(expert, dense_mlp), name
    assert "--save" in refusal and "already holds a checkpoint" in refusal and "drop --moe-use-upcycling" in refusal
    assert "--num-layers: 2 in the checkpoint, 3 in this run" in mismatch


def test_granular_upcycling_and_missing_checkpoints_are_refused(monkeypatch):
    from megatron.training.arguments import parse_args, validate_args

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match="--moe-upcycling-granularity 2: granular upcycling"):
        validate_args(parse_args(args=f"{DENSE} {MOE} --load a --save b --moe-upcycling-granularity 2".split()))
    with pytest.raises(ValueError, match="--moe-use-upcycling needs --save"):
        validate_args(parse_args(args=f"{DENSE} {MOE} --load a".split()))
