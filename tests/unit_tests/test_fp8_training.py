"""FP8 training end to end through `pretrain(argv=...)` on 2 ranks: the README's tiny GPT (4 layers, hidden 128,
rope, RMSNorm, swiglu; sequence length 64 here to stay fast) on the bundled corpus, byte-level tokens.

- FP8 (hybrid, delayed scaling) tracks the fp32 loss curve within a documented bound, and differs from it.
- `--fp8-param-gather` with the distributed optimizer gives the same losses as FP8 without it (tensorwise
  scaling: both quantize each weight with the amax of the full weight), and all-gathers the FP8 weights as one
  byte per element.
- A run with `--fp8-param-gather` resumed from its checkpoint continues exactly like the uninterrupted run.
- `--first-last-layers-bf16` keeps the first and last layers out of FP8: after a run (the smaller mock-data GPT of
  the checkpoint tests, on one rank) their layers have recorded no amax, the middle layers one per step.
"""

import json
import os

import pytest

from tests.unit_tests.corpus_data import write_corpus_prefix
from tests.unit_tests.multiprocess_harness import run_on_ranks

NUM_DOCUMENTS = 400
TRAIN_ITERS = 8

TINY_GPT = (
    "--num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
    "--position-embedding-type rope --normalization RMSNorm --swiglu --hidden-dropout 0 --attention-dropout 0 "
    "--make-vocab-size-divisible-by 64 --micro-batch-size 4 --global-batch-size 8 --lr 3e-3 --min-lr 3e-4 "
    "--lr-decay-style cosine --lr-warmup-iters 2 --weight-decay 0.1 --clip-grad 1.0 --seed 1234 "
    "--tokenizer-type ByteLevelTokenizer --split 100,0,0 --num-workers 0 --log-interval 1 --eval-iters 0 "
    "--ckpt-format torch --use-distributed-optimizer"
)
# FP8 against fp32 over the first 8 iterations: the loss falls by ~1.6 nats while per-iteration differences
# stay below ~0.02 (FP8 rounds every GEMM operand with a relative error up to 2**-4); 0.05 leaves headroom, and
# the curves must differ by more than 1e-4 somewhere, or FP8 was not in effect.
FP8_LOSS_BOUND = 0.05
# Losses of identical computations on different code paths (summation order only).
PARITY_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def corpus_prefix(tmp_path_factory):
    return write_corpus_prefix(tmp_path_factory.mktemp("fp8_corpus"), NUM_DOCUMENTS)


def _pretrain_and_count_gathers(argv):
    """Runs pretrain; returns the losses and the (dtype, bytes) of every all_gather_into_tensor this rank made."""
    import torch.distributed as dist

    import pretrain_gpt
    from megatron.core.enums import ModelType
    from megatron.training.training import pretrain

    gathers = []
    original = dist.all_gather_into_tensor

    def counting_all_gather(output, input_, *args, **kwargs):
        gathers.append((str(output.dtype), output.numel() * output.element_size()))
        return original(output, input_, *args, **kwargs)

    dist.all_gather_into_tensor = counting_all_gather
    try:
        pretrain(pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider,
                 ModelType.encoder_or_decoder, pretrain_gpt.forward_step, argv=argv.split())
    finally:
        dist.all_gather_into_tensor = original
    return gathers


def _run(corpus_prefix, workdir, extra, iters=TRAIN_ITERS):
    metrics = os.path.join(workdir, "metrics.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    base = TINY_GPT
    if "--megatron-ddp" in extra:  # the test's marker for plain Megatron DDP: no distributed optimizer
        base, extra = TINY_GPT.replace(" --use-distributed-optimizer", ""), extra.replace("--megatron-ddp", "")
    argv = f"{base} --data-path {corpus_prefix} --train-iters {iters} --metrics-file {metrics} {extra}"
    gathers = run_on_ranks(2, _pretrain_and_count_gathers, argv)
    with open(metrics) as records:
        losses = {record["iteration"]: record["lm loss"] for record in map(json.loads, records)}
    return losses, gathers[0]


_RUNS = {}
TENSORWISE = "--fp8-format hybrid --fp8-recipe tensorwise"


def _shared_run(corpus_prefix, tmp_path_factory, extra):
    """`_run` once per set of extra flags for the whole module (tests compare the same runs); returns the losses,
    the gathers and the gradient norms (before clipping) per iteration."""
    if extra not in _RUNS:
        workdir = str(tmp_path_factory.mktemp("fp8_run"))
        losses, gathers = _run(corpus_prefix, workdir, extra)
        with open(os.path.join(workdir, "metrics.jsonl")) as records:
            grad_norms = {record["iteration"]: record["grad norm"] for record in map(json.loads, records)}
        _RUNS[extra] = losses, gathers, grad_norms
    return _RUNS[extra]


def test_fp8_training_tracks_fp32_and_fp8_param_gather_matches(corpus_prefix, tmp_path, tmp_path_factory):
    fp32, fp32_gathers = _run(corpus_prefix, str(tmp_path), "")
    delayed, _ = _run(corpus_prefix, str(tmp_path),
                      "--fp8-format hybrid --fp8-amax-history-len 4 --fp8-amax-compute-algo max")
    tensorwise = _shared_run(corpus_prefix, tmp_path_factory, TENSORWISE)[0]
    gathered, fp8_gathers = _run(corpus_prefix, str(tmp_path), f"{TENSORWISE} --fp8-param-gather")

    iterations = list(range(1, TRAIN_ITERS + 1))
    assert sorted(fp32) == iterations and fp32[TRAIN_ITERS] < fp32[1] - 1.0  # the model learns
    for name, fp8 in (("delayed", delayed), ("tensorwise", tensorwise)):
        differences = [abs(fp8[i] - fp32[i]) for i in iterations]
        assert max(differences) < FP8_LOSS_BOUND, (name, differences)
        assert max(differences) > 1e-4, (name, differences)
    for i in iterations:
        assert gathered[i] == pytest.approx(tensorwise[i], abs=PARITY_TOLERANCE), (i, gathered, tensorwise)

    # fp32 run: the parameter buffers are all-gathered in fp32 once per step. FP8 run: the linear weights of the
    # transformer layers travel as uint8 (1 byte per element, a quarter of their fp32 bytes) and the rest
    # (embedding, norms, biases) as fp32; one extra round at start-up installs the initial FP8 weights.
    assert {dtype for dtype, _ in fp32_gathers} == {"torch.float32"}
    fp32_bytes_per_step = sum(size for _, size in fp32_gathers) / TRAIN_ITERS
    fp8_weight_bytes = sum(size for dtype, size in fp8_gathers if dtype == "torch.uint8") / (TRAIN_ITERS + 1)
    rest_bytes = sum(size for dtype, size in fp8_gathers if dtype == "torch.float32") / (TRAIN_ITERS + 1)
    assert {dtype for dtype, _ in fp8_gathers} == {"torch.uint8", "torch.float32"}
    # Buffers are padded to a multiple of DP=2 elements each: splitting one buffer in two adds at most 1.
    assert fp32_bytes_per_step - (4 * fp8_weight_bytes + rest_bytes) in (0, -4)
    assert 4 * fp8_weight_bytes > 0.5 * fp32_bytes_per_step  # most bytes are linear weights
    print(f"all-gathered bytes per step: fp32 {fp32_bytes_per_step:.0f}, fp8 param gather "
          f"{fp8_weight_bytes + rest_bytes:.0f} ({fp8_weight_bytes:.0f} as FP8)")


# FP8 under another data-parallel wrapper from the same initial weights and data: the first step computes the same
# gradients (each rank quantizes the same activations and weights; at DP2 a sum of two gradients does not depend on
# the order of the reduction), so the losses of iterations 1 and 2 (the latter after the first update) agree to
# fp32 summation order (measured: identical), and so do the gradient norms of those iterations. Later steps differ
# only where the wrappers' gradient-norm sums (for clipping) round differently in the last bit, which FP8 rounding
# then amplifies: measured at most 3e-6 at iteration 3 and 5e-4 by iteration 8. On this model (measured on the
# README's corpus) FP8 weight gradients dropped entirely move the loss of iteration 3 by 0.14; counted twice, they
# leave the losses within 0.02 (Adam is nearly scale-free) but change the gradient norm of iteration 1.
WRAPPER_PARITY_EARLY_ITERS = 2
WRAPPER_PARITY_EARLY_TOLERANCE = 1e-5
WRAPPER_PARITY_LATE_TOLERANCE = 1e-2


@pytest.mark.parametrize("wrapper_flags", [
    "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params",
    "--megatron-ddp",
], ids=["megatron_fsdp_z3", "megatron_ddp"])
def test_fp8_trains_alike_under_each_data_parallel_wrapper(corpus_prefix, tmp_path_factory, wrapper_flags):
    """Tensorwise FP8 under Megatron-FSDP ZeRO-3 and under Megatron DDP against the distributed optimizer's run."""
    reference, _, reference_norms = _shared_run(corpus_prefix, tmp_path_factory, TENSORWISE)
    other, _, other_norms = _shared_run(corpus_prefix, tmp_path_factory, f"{TENSORWISE} {wrapper_flags}")
    assert sorted(other) == sorted(reference) == list(range(1, TRAIN_ITERS + 1))
    for i in range(1, WRAPPER_PARITY_EARLY_ITERS + 1):  # the same gradients, before any clipping differs
        assert other_norms[i] == pytest.approx(reference_norms[i], rel=WRAPPER_PARITY_EARLY_TOLERANCE), (i, other_norms)
    for i in reference:
        tolerance = WRAPPER_PARITY_EARLY_TOLERANCE if i <= WRAPPER_PARITY_EARLY_ITERS else WRAPPER_PARITY_LATE_TOLERANCE
        assert other[i] == pytest.approx(reference[i], abs=tolerance), (i, other, reference)


def test_fp8_param_gather_checkpoint_round_trip(corpus_prefix, tmp_path):
    # Saved after iteration 2: iteration 3 computes with the loaded weights, iteration 4 with the weights the
    # loaded optimizer state updated.
    extra = f"--fp8-format hybrid --fp8-recipe tensorwise --fp8-param-gather --save {tmp_path}/ckpt --save-interval 2"
    uninterrupted, _ = _run(corpus_prefix, str(tmp_path), extra, iters=4)
    os.rename(f"{tmp_path}/ckpt", f"{tmp_path}/ckpt_full")
    first_half, _ = _run(corpus_prefix, str(tmp_path), f"{extra} --exit-interval 2", iters=4)
    resumed, _ = _run(corpus_prefix, str(tmp_path), f"{extra} --load {tmp_path}/ckpt", iters=4)
    assert sorted(resumed) == [3, 4]
    for i in (1, 2):
        assert first_half[i] == uninterrupted[i]  # the same computation
    for i in (3, 4):
        assert resumed[i] == pytest.approx(uninterrupted[i], abs=PARITY_TOLERANCE), (resumed, uninterrupted)


FIRST_LAST_BF16_ITERS = 2
MICROBATCHES_PER_ITER = 4  # the checkpoint tests' tiny GPT: global batch 8, micro batch 2, one rank


def _amax_counts_after_pretrain(workdir):
    """pretrain() with `--first-last-layers-bf16` (delayed scaling); per global layer number, the amax counts
    and the largest recorded amax of each linear layer (input, weight, output gradient)."""
    import pretrain_gpt
    from megatron.core.dist_checkpointing.model_state import unwrap_model
    from tests.unit_tests.dist_checkpointing.pretrain_helpers import run_pretrain

    models = []

    def forward_step(data_iterator, model):
        models.append(model)
        return pretrain_gpt.forward_step(data_iterator, model)

    iters = FIRST_LAST_BF16_ITERS
    losses = run_pretrain(workdir, f"--fp8-format hybrid --fp8-recipe delayed --first-last-layers-bf16 "
                                   f"--train-iters {iters} --lr-decay-iters {iters} --lr-warmup-iters 1", forward_step)
    model = unwrap_model(models[0])
    layers = {}
    for layer in model.decoder.layers:
        layers[layer.layer_number] = {
            name: (module.fp8_amax_recorded_count.tolist(), module.fp8_amax_history.max().item())
            for name, module in layer.named_modules() if hasattr(module, "fp8_amax_recorded_count")
        }
    return losses, layers, len(models)


def test_first_last_layers_bf16_keeps_the_first_and_last_layers_out_of_fp8(tmp_path):
    losses, layers, passes = run_on_ranks(1, _amax_counts_after_pretrain, str(tmp_path))[0]
    assert sorted(losses) == list(range(1, FIRST_LAST_BF16_ITERS + 1))
    assert passes == FIRST_LAST_BF16_ITERS * MICROBATCHES_PER_ITER
    assert sorted(layers) == [1, 2, 3, 4]
    linears = ["mlp.linear_fc1", "mlp.linear_fc2", "self_attention.linear_proj", "self_attention.linear_qkv"]
    for layer_number, per_linear in layers.items():
        assert sorted(per_linear) == linears, layer_number
        for name, (counts, largest_amax) in per_linear.items():
            if layer_number in (1, 4):  # layers 0 and N-1 (0-based) ran in high precision: nothing recorded
                assert counts == [0, 0, 0] and largest_amax == 0.0, (layer_number, name)
            else:
                # All amaxes of a step (every microbatch's forward and backward) are reduced and recorded once,
                # at the step's end.
                assert counts == [FIRST_LAST_BF16_ITERS] * 3, (layer_number, name, counts)
                assert largest_amax > 0.0, (layer_number, name)
