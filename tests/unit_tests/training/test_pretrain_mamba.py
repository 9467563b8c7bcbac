"""pretrain_mamba.py end to end on a hybrid model (Mamba, attention and MLP layers): every data-parallel wrapper,
tensor parallelism with sequence parallelism, context parallelism, pipeline parallelism (also interleaved) and full
activation recompute log the losses of Megatron DDP on one layout, and a torch_dist checkpoint saved under DDP
resumes under Megatron-FSDP ZeRO-3 at TP 2 on the uninterrupted run's losses. Latent MoE 'E' layers
(--moe-latent-size) log the same losses under every wrapper and layout, and resume from DDP under EP 2."""

import pytest
import torch

from tests.unit_tests.dist_checkpointing.pretrain_helpers import pretrain_records
from tests.unit_tests.multiprocess_harness import run_on_ranks

HYBRID = ("--num-layers 4 --hybrid-override-pattern M*M- --hidden-size 32 --num-attention-heads 4 "
          "--mamba-head-dim 8 --mamba-num-groups 2 --mamba-state-dim 8 --seq-length 32 --max-position-embeddings 32 "
          "--position-embedding-type none --normalization RMSNorm --swiglu --hidden-dropout 0 --attention-dropout 0 "
          "--micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --lr-decay-iters 4 --train-iters 4 --seed 11 "
          "--init-method-std 0.1 --mock-data --tokenizer-type NullTokenizer --vocab-size 127 "
          "--make-vocab-size-divisible-by 64 --num-workers 0 --log-interval 1 --eval-iters 0 "
          "--distributed-backend gloo")
LAYOUTS = {
    "megatron_fsdp_z3": "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params",
    "tp2_sp": "--tensor-model-parallel-size 2 --sequence-parallel",
    "pp2": "--pipeline-model-parallel-size 2",
    "pp2_interleaved": "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1",
    "recompute": "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1",
    "cp2": "--context-parallel-size 2",
    "offloaded": "--fine-grained-activation-offloading --offload-modules attn_norm qkv_linear core_attn attn_proj "
                 "mlp_norm",
}


def _losses(workdir, name, extra):
    records = pretrain_records(f"{workdir}/{name}", f"{HYBRID} {extra}", script="pretrain_mamba")
    return [record["lm loss"] for record in records]


def _all_runs(workdir):
    losses = {"ddp": _losses(workdir, "ddp", "")}
    for name, extra in LAYOUTS.items():
        losses[name] = _losses(workdir, name, extra)
    losses["fp8"] = _losses(workdir, "fp8", "--fp8-format hybrid --fp8-recipe tensorwise")
    untied = "--untie-embeddings-and-output-weights"
    losses["ddp_untied"] = _losses(workdir, "ddp_untied", untied)
    losses["fsdp2_untied"] = _losses(workdir, "fsdp2_untied", f"{untied} --use-torch-fsdp2")
    moe = "--hybrid-override-pattern M*E- --num-experts 4 --moe-router-topk 2 --moe-aux-loss-coeff 0.01"
    losses["moe"] = _losses(workdir, "moe", moe)
    losses["moe_ep2_fsdp"] = _losses(workdir, "moe_ep2_fsdp", f"{moe} --expert-model-parallel-size 2 "
                                                              f"{LAYOUTS['megatron_fsdp_z3']}")
    # Latent MoE: every data-parallel wrapper and layout of the 'E' layer against DDP; a torch_dist checkpoint saved
    # under DDP resumes with the experts split over 2 ranks under Megatron-FSDP.
    latent = f"{moe} --moe-latent-size 16 --moe-shared-expert-intermediate-size 32"
    latent_layouts = {"ddp": "", "ep2_fsdp": f"--expert-model-parallel-size 2 {LAYOUTS['megatron_fsdp_z3']}",
                      "ep2_fsdp_z1": "--expert-model-parallel-size 2 --use-megatron-fsdp "
                                     "--data-parallel-sharding-strategy optim",
                      "fsdp2": "--use-torch-fsdp2 --untie-embeddings-and-output-weights",
                      "ddp_untied": "--untie-embeddings-and-output-weights",
                      "tp2_sp_dist_opt": f"{LAYOUTS['tp2_sp']} --use-distributed-optimizer --moe-grouped-gemm "
                                         "--moe-token-dispatcher-type alltoall --moe-layer-recompute",
                      "pp2": LAYOUTS["pp2"]}
    for name, extra in latent_layouts.items():
        losses[f"latent_{name}"] = _losses(workdir, f"latent_{name}", f"{latent} {extra}")
    latent_checkpoints = f"{workdir}/latent_checkpoints"
    losses["latent_saved"] = _losses(workdir, "latent_saved", f"{latent} --save {latent_checkpoints} --save-interval 2 "
                                                              "--ckpt-format torch_dist --exit-interval 2")
    losses["latent_resumed"] = _losses(workdir, "latent_resumed", f"{latent} --load {latent_checkpoints} --ckpt-format "
                                                                  f"torch_dist {latent_layouts['ep2_fsdp']}")
    checkpoints = f"{workdir}/checkpoints"
    save = f"--save {checkpoints} --save-interval 2 --ckpt-format torch_dist"
    losses["saved"] = _losses(workdir, "saved", f"{save} --exit-interval 2")
    losses["resumed"] = _losses(workdir, "resumed", f"--load {checkpoints} --ckpt-format torch_dist "
                                                    f"{LAYOUTS['megatron_fsdp_z3']} --tensor-model-parallel-size 2")
    return losses


@pytest.mark.parametrize("world_size", [2])
def test_every_layout_and_wrapper_trains_the_hybrid_model_alike(world_size, tmp_path):
    losses = run_on_ranks(world_size, _all_runs, str(tmp_path))[0]
    reference = torch.tensor(losses["ddp"])
    assert len(reference) == 4
    # The same computation, other data-parallel sharding or pipeline split: fp32 sums in another order at most.
    for name in ("megatron_fsdp_z3", "pp2", "pp2_interleaved", "recompute", "offloaded"):
        torch.testing.assert_close(torch.tensor(losses[name]), reference, rtol=1e-6, atol=0)
    # Tensor parallelism splits the mixer by groups and reduces partial sums over 2 ranks; context parallelism
    # scans each rank's share of the groups over the whole sequence (all-to-all) and sums the loss over 2 ranks.
    for name in ("tp2_sp", "cp2"):
        torch.testing.assert_close(torch.tensor(losses[name]), reference, rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(losses["fsdp2_untied"]), torch.tensor(losses["ddp_untied"]),
                               rtol=1e-6, atol=0)
    # FP8 (CPU emulation of the projections' GEMMs; convolution and scan stay fp32): the fp32 curve within the bound
    # of tests/unit_tests/test_fp8_training.py, and not equal to it (FP8 in effect).
    fp8_gap = (torch.tensor(losses["fp8"]) - reference).abs()
    assert fp8_gap.max() < 0.05 and fp8_gap.max() > 1e-4, fp8_gap
    # MoE layers ('E'): experts split over 2 ranks under Megatron-FSDP, as all experts on every rank under DDP.
    torch.testing.assert_close(torch.tensor(losses["moe_ep2_fsdp"]), torch.tensor(losses["moe"]), rtol=1e-6, atol=0)
    assert losses["moe"] != losses["ddp"]
    # Latent MoE: the same computation under every wrapper and layout (TP 2 sums partial products over 2 ranks).
    latent = torch.tensor(losses["latent_ddp"])
    for name in ("ep2_fsdp", "ep2_fsdp_z1", "pp2"):
        torch.testing.assert_close(torch.tensor(losses[f"latent_{name}"]), latent, rtol=1e-6, atol=0)
    torch.testing.assert_close(torch.tensor(losses["latent_tp2_sp_dist_opt"]), latent, rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(losses["latent_fsdp2"]), torch.tensor(losses["latent_ddp_untied"]),
                               rtol=1e-6, atol=0)
    assert losses["latent_ddp"] != losses["moe"] and losses["latent_saved"] == losses["latent_ddp"][:2]
    torch.testing.assert_close(torch.tensor(losses["latent_resumed"]), latent[2:], rtol=1e-6, atol=0)
    # Saved at iteration 2 under DDP, resumed at TP 2 under Megatron-FSDP ZeRO-3: iterations 3 and 4 as uninterrupted.
    assert losses["saved"] == losses["ddp"][:2]
    torch.testing.assert_close(torch.tensor(losses["resumed"]), reference[2:], rtol=1e-5, atol=0)
