"""pretrain_gpt.py with latent MoE layers (`--moe-latent-size`) on three data-parallel ranks: the projections and
the latent-width experts shard unevenly under Megatron-FSDP ZeRO-3 and FSDP2 and train as under Megatron DDP."""

import torch

from tests.unit_tests.dist_checkpointing.pretrain_helpers import pretrain_records
from tests.unit_tests.multiprocess_harness import run_on_ranks

MODEL = ("--num-layers 2 --hidden-size 48 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
         "--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 40 --moe-latent-size 24 "
         "--moe-shared-expert-intermediate-size 32 --moe-aux-loss-coeff 0.01 --normalization RMSNorm --swiglu "
         "--hidden-dropout 0 --attention-dropout 0 --micro-batch-size 2 --global-batch-size 6 --lr 3e-3 "
         "--lr-decay-iters 4 --train-iters 4 --seed 5 --init-method-std 0.1 --mock-data --tokenizer-type "
         "NullTokenizer --vocab-size 127 --make-vocab-size-divisible-by 64 --num-workers 0 --log-interval 1 "
         "--eval-iters 0 --distributed-backend gloo --untie-embeddings-and-output-weights")
WRAPPERS = {"ddp": "", "megatron_fsdp_z3": "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params",
            "fsdp2": "--use-torch-fsdp2"}


def _runs(workdir):
    return {name: [record["lm loss"] for record in pretrain_records(f"{workdir}/{name}", f"{MODEL} {extra}")]
            for name, extra in WRAPPERS.items()}


def test_three_ranks_train_the_latent_moe_model_alike_under_every_wrapper(tmp_path):
    losses = run_on_ranks(3, _runs, str(tmp_path))[0]
    reference = torch.tensor(losses["ddp"])
    assert len(reference) == 4
    for name in ("megatron_fsdp_z3", "fsdp2"):
        torch.testing.assert_close(torch.tensor(losses[name]), reference, rtol=1e-6, atol=0)
