"""pretrain_gpt.py end to end on a heterogeneous model (`--heterogeneous-layers-config-path`): layers of their own
query groups and MLP widths, a dropped attention, a dropped MLP and both linear replacements. Every data-parallel
wrapper, tensor parallelism with sequence parallelism, context parallelism, pipeline parallelism and full activation
recompute log the losses of Megatron DDP on one layout, and a torch_dist checkpoint saved under DDP resumes under
Megatron-FSDP ZeRO-3 at TP 2 from the saved arguments alone (no config file) on the uninterrupted run's losses."""

import json
import os

import pytest
import torch

from tests.unit_tests.dist_checkpointing.pretrain_helpers import pretrain_records
from tests.unit_tests.multiprocess_harness import run_on_ranks

# Widths at hidden 64: ffn_mult 2.0 -> 256, 7.0 -> 512 (multiples of 256).
BLOCK_CONFIGS = [
    {"attention": {"n_heads_in_group": 2, "no_op": False, "replace_with_linear": False},
     "ffn": {"ffn_mult": 2.0, "no_op": False, "replace_with_linear": False}},
    {"attention": {"n_heads_in_group": None, "no_op": True, "replace_with_linear": False},
     "ffn": {"ffn_mult": None, "no_op": False, "replace_with_linear": True}},
    {"attention": {"n_heads_in_group": None, "no_op": False, "replace_with_linear": True},
     "ffn": {"ffn_mult": 7.0, "no_op": False, "replace_with_linear": False}},
    {"attention": {"n_heads_in_group": 1, "no_op": False, "replace_with_linear": False},
     "ffn": {"ffn_mult": None, "no_op": True, "replace_with_linear": False}},
]
MODEL = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
         "--position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear --hidden-dropout 0 "
         "--attention-dropout 0 --micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --lr-decay-iters 4 "
         "--train-iters 4 --seed 11 --init-method-std 0.1 --mock-data --tokenizer-type NullTokenizer "
         "--vocab-size 127 --make-vocab-size-divisible-by 64 --num-workers 0 --log-interval 1 --eval-iters 0 "
         "--distributed-backend gloo")
LAYOUTS = {
    "distributed_optimizer": "--use-distributed-optimizer",
    "megatron_fsdp_z3": "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params",
    "tp2_sp": "--tensor-model-parallel-size 2 --sequence-parallel",
    "pp2": "--pipeline-model-parallel-size 2",
    "cp2": "--context-parallel-size 2",
    "recompute": "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1",
}


def _losses(workdir, name, argv):
    return [record["lm loss"] for record in pretrain_records(f"{workdir}/{name}", argv)]


def _all_runs(workdir):
    config_path = f"{workdir}/config.json"
    if torch.distributed.get_rank() == 0:
        with open(config_path, "w") as handle:
            json.dump({"model_type": "nemotron-nas", "hidden_size": 64, "block_configs": BLOCK_CONFIGS}, handle)
    torch.distributed.barrier()
    model = f"{MODEL} --heterogeneous-layers-config-path {config_path}"
    losses = {"ddp": _losses(workdir, "ddp", model), "homogeneous": _losses(workdir, "homogeneous", MODEL)}
    for name, extra in LAYOUTS.items():
        losses[name] = _losses(workdir, name, f"{model} {extra}")
    losses["fp8"] = _losses(workdir, "fp8", f"{model} --fp8-format hybrid --fp8-recipe tensorwise")
    untied = "--untie-embeddings-and-output-weights"
    losses["ddp_untied"] = _losses(workdir, "ddp_untied", f"{model} {untied}")
    losses["fsdp2_untied"] = _losses(workdir, "fsdp2_untied", f"{model} {untied} --use-torch-fsdp2")
    checkpoints = f"{workdir}/checkpoints"
    losses["saved"] = _losses(workdir, "saved", f"{model} --save {checkpoints} --save-interval 2 "
                                                f"--ckpt-format torch_dist --exit-interval 2")
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        os.remove(config_path)  # the checkpoint's arguments carry the layers
    torch.distributed.barrier()
    losses["resumed"] = _losses(workdir, "resumed", f"{MODEL} --load {checkpoints} --ckpt-format torch_dist "
                                                    f"--use-checkpoint-args {LAYOUTS['megatron_fsdp_z3']} "
                                                    "--tensor-model-parallel-size 2 --sequence-parallel")
    return losses


@pytest.mark.parametrize("world_size", [2])
def test_every_layout_and_wrapper_trains_the_heterogeneous_model_alike(world_size, tmp_path):
    losses = run_on_ranks(world_size, _all_runs, str(tmp_path))[0]
    reference = torch.tensor(losses["ddp"])
    assert len(reference) == 4
    assert losses["homogeneous"] != losses["ddp"]  # the block configs are in effect
    # The same computation, other data-parallel sharding or pipeline split: fp32 sums in another order at most.
    for name in ("distributed_optimizer", "megatron_fsdp_z3", "pp2", "recompute"):
        torch.testing.assert_close(torch.tensor(losses[name]), reference, rtol=1e-6, atol=0)
    # Partial sums over 2 tensor-parallel ranks, or attention and loss split over 2 context-parallel ranks.
    for name in ("tp2_sp", "cp2"):
        torch.testing.assert_close(torch.tensor(losses[name]), reference, rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(losses["fsdp2_untied"]), torch.tensor(losses["ddp_untied"]),
                               rtol=1e-6, atol=0)
    # FP8 (CPU emulation of every linear's GEMMs, the linear stand-ins' too): near the fp32 curve, not equal to it.
    fp8_gap = (torch.tensor(losses["fp8"]) - reference).abs()
    assert 1e-4 < fp8_gap.max() < 0.05, fp8_gap
    # Saved at iteration 2 under DDP, resumed at TP 2 under Megatron-FSDP ZeRO-3: iterations 3 and 4 as uninterrupted.
    assert losses["saved"] == losses["ddp"][:2]
    torch.testing.assert_close(torch.tensor(losses["resumed"]), reference[2:], rtol=1e-5, atol=0)


def _three_rank_runs(workdir):
    config_path = f"{workdir}/config.json"
    if torch.distributed.get_rank() == 0:
        with open(config_path, "w") as handle:
            json.dump({"block_configs": BLOCK_CONFIGS}, handle)
    torch.distributed.barrier()
    model = f"{MODEL} --heterogeneous-layers-config-path {config_path} --global-batch-size 6"
    return {"ddp": _losses(workdir, "ddp", model),
            "megatron_fsdp_z3": _losses(workdir, "fsdp", f"{model} {LAYOUTS['megatron_fsdp_z3']}"),
            "fsdp2_untied": _losses(workdir, "fsdp2", f"{model} --untie-embeddings-and-output-weights "
                                                      "--use-torch-fsdp2"),
            "ddp_untied": _losses(workdir, "ddp_untied", f"{model} --untie-embeddings-and-output-weights")}


def test_three_data_parallel_ranks_shard_the_heterogeneous_layers_unevenly_and_train_alike(tmp_path):
    """Three ranks: the layers' parameters (64 x 64 stand-ins next to 512-wide MLPs) split into uneven shards."""
    losses = run_on_ranks(3, _three_rank_runs, str(tmp_path))[0]
    torch.testing.assert_close(torch.tensor(losses["megatron_fsdp_z3"]), torch.tensor(losses["ddp"]), rtol=1e-6,
                               atol=0)
    torch.testing.assert_close(torch.tensor(losses["fsdp2_untied"]), torch.tensor(losses["ddp_untied"]), rtol=1e-6,
                               atol=0)
