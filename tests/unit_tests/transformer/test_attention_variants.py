"""Sliding-window attention and attention sinks (`--window-size`, `--window-attn-skip-freq`, `--softmax-type`):
the layer pattern and masks against hand-written rules, the sink softmax and its parameter's gradient against a
reference written here, TP2 against TP1, context parallelism against CP1, the data-parallel wrappers against each
other, and the rules, checkpoint records and HF export refusal that name the flags."""

import math
import os
import types

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.attention_variants import (
    attention_with_sinks,
    is_layer_window_attention,
    parse_window_size,
    window_blocked,
    window_layer_pattern,
)
from tests.unit_tests.models.gpt.gpt_test_utils import reference_then_parallel, tiny_config
from tests.unit_tests.multiprocess_harness import run_on_ranks

REPOSITORY = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

SEQ, BATCH, HEADS, HIDDEN = 8, 2, 4, 32


def test_layer_pattern_follows_upstream():
    # An int N: every N-th layer (1-based) is full attention; a list: 1 is the window.
    assert window_layer_pattern((4, 0), 2, 4) == [True, False, True, False]
    assert window_layer_pattern((4, 0), 3, 6) == [True, True, False, True, True, False]
    assert window_layer_pattern((4, 0), (0, 1, 1, 0), 4) == [False, True, True, False]
    assert window_layer_pattern((4, 0), None, 3) == [True, True, True]
    assert not is_layer_window_attention(None, 2, 1)
    assert parse_window_size("(128, 0)") == parse_window_size("128,0") == (128, 0)


@pytest.mark.parametrize("window", [(2, 0), (0, 0), (-1, 0), (3, 5), (2, -1)])
def test_window_mask_against_the_rule(window):
    left, right = window
    queries, keys = torch.arange(3, 9), torch.arange(9)  # decoding-like: query rows at positions 3 .. 8
    blocked = window_blocked(queries, keys, window)
    for row, i in enumerate(queries.tolist()):
        for j in keys.tolist():
            seen = j <= i and (left < 0 or j >= i - left) and (right < 0 or j <= i + right)
            assert bool(blocked[row, j]) == (not seen), (window, i, j)


def _reference_attention(query, key, value, sinks, window):
    """[b, h, s, d] inputs, one query and key at a time: p_ij = exp(l_ij) / (exp(sink_h) + sum_k exp(l_ik))."""
    out = torch.zeros_like(query)
    scale = 1.0 / math.sqrt(query.shape[-1])
    for b in range(query.shape[0]):
        for h in range(query.shape[1]):
            for i in range(query.shape[2]):
                visible = [j for j in range(key.shape[2])
                           if j <= i and (window is None or window[0] < 0 or j >= i - window[0])]
                logits = torch.stack([(query[b, h, i] * key[b, h, j]).sum() * scale for j in visible])
                denominator = logits.exp().sum() + (0.0 if sinks is None else sinks[h].exp())
                out[b, h, i] = sum(logit.exp() / denominator * value[b, h, j] for logit, j in zip(logits, visible))
    return out


@pytest.mark.parametrize("sinks_kind", ["off-by-one", "learnable"])
def test_sink_softmax_and_its_gradient_against_a_reference(sinks_kind):
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(BATCH, HEADS, SEQ, 4, generator=generator, dtype=torch.float64)
                         for _ in range(3))
    logits = (torch.zeros(HEADS, dtype=torch.float64) if sinks_kind == "off-by-one"
              else torch.randn(HEADS, generator=generator, dtype=torch.float64))
    sinks = logits.clone().requires_grad_(True)
    blocked = window_blocked(torch.arange(SEQ), torch.arange(SEQ), (2, 0))
    output = attention_with_sinks(query, key, value, blocked, sinks)
    reference_sinks = logits.clone().requires_grad_(True)
    expected = _reference_attention(query, key, value, reference_sinks, (2, 0))
    torch.testing.assert_close(output, expected, atol=1e-12, rtol=1e-12)
    weights = torch.randn(output.shape, generator=generator, dtype=torch.float64)
    (output * weights).sum().backward()
    (expected * weights).sum().backward()
    torch.testing.assert_close(sinks.grad, reference_sinks.grad, atol=1e-12, rtol=1e-12)
    assert sinks.grad.abs().min() > 0
    # The sink takes mass away: the output differs from plain attention under the same window.
    assert (output - _reference_attention(query, key, value, None, (2, 0))).abs().max() > 1e-3
    # A query whose keys are all masked attends to the sink only.
    nothing = attention_with_sinks(query, key, value, torch.ones(SEQ, SEQ, dtype=torch.bool), sinks.detach())
    assert torch.equal(nothing, torch.zeros_like(nothing))


def _attention_and_reference(**overrides):
    """A SelfAttention layer of `tiny_config(**overrides)`, its output, and the reference computed from its own
    queries, keys and values."""
    from megatron.core.transformer.attention import SelfAttention

    tensor_parallel.model_parallel_cuda_manual_seed(3)
    attention = SelfAttention(tiny_config(**overrides), layer_number=1)
    if attention.softmax_offset is not None:
        with torch.no_grad():
            attention.softmax_offset.copy_(torch.tensor([0.5, -1.0, 2.0, 0.0]))
    hidden = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(4))
    output, bias = attention(hidden)  # (output, bias) as upstream; the reference's linear_proj skips it too
    assert bias is attention.linear_proj.bias
    mixed = attention.linear_qkv(hidden)[0].view(SEQ, BATCH, HEADS, 3, HIDDEN // HEADS)
    query, key, value = (mixed[:, :, :, part].permute(1, 2, 0, 3) for part in range(3))
    sinks = {"vanilla": None, "off-by-one": torch.zeros(HEADS),
             "learnable": attention.softmax_offset}[attention.config.softmax_type]
    context = _reference_attention(query, key, value, sinks, attention.window_size)
    expected = attention.linear_proj(context.permute(2, 0, 1, 3).reshape(SEQ, BATCH, HIDDEN))[0]
    return attention, output, expected


@pytest.mark.parametrize("overrides", [dict(window_size=(2, 0)), dict(softmax_type="off-by-one"),
                                       dict(window_size=(3, 0), softmax_type="learnable")])
def test_self_attention_equals_the_reference(overrides):
    attention, output, expected = _attention_and_reference(**overrides)
    torch.testing.assert_close(output, expected, atol=1e-5, rtol=1e-5)
    _, plain, _ = _attention_and_reference()
    assert (output - plain).abs().max() > 1e-3  # the variant changes the result


def test_learnable_sinks_parameter():
    from megatron.core.optimizer import OptimizerConfig, get_param_groups
    from megatron.core.transformer.attention import SelfAttention

    tensor_parallel.model_parallel_cuda_manual_seed(3)
    attention = SelfAttention(tiny_config(softmax_type="learnable"), layer_number=1)
    offset = dict(attention.named_parameters())["softmax_offset"]
    assert offset.shape == (HEADS,) and torch.equal(offset, torch.zeros(HEADS))  # upstream: zeros
    assert offset.tensor_model_parallel and offset.partition_dim == 0
    with torch.no_grad():
        offset.fill_(3.0)
    attention.reset_parameters()  # what meta-device materialisation calls
    assert torch.equal(offset, torch.zeros(HEADS))
    groups = get_param_groups([attention], OptimizerConfig(lr=1e-3, weight_decay=0.1))
    decay_of = {id(p): group["wd_mult"] for group in groups for p in group["params"]}
    assert decay_of[id(offset)] == 0.0 and decay_of[id(attention.linear_qkv.weight)] == 1.0
    # Off-by-one and vanilla add no parameter.
    for kind in ("vanilla", "off-by-one"):
        assert "softmax_offset" not in dict(SelfAttention(tiny_config(softmax_type=kind), 1).named_parameters())


def test_checkpoint_placement_splits_the_sinks_by_heads():
    from megatron.core.dist_checkpointing.logical_names import TensorParallelRank, placement_of
    from megatron.core.transformer.attention import SelfAttention

    attention = SelfAttention(tiny_config(softmax_type="learnable", tp=2), layer_number=1)
    name = "decoder.layers.1.self_attention.softmax_offset"
    placement = placement_of(name, attention.softmax_offset, 2, TensorParallelRank(1, 2))
    assert placement.logical_name == "decoder.layers.3.self_attention.softmax_offset"
    assert placement.global_shape == (HEADS,) and placement.offsets((HEADS // 2,)) == (HEADS // 2,)


def test_logit_tracking_counts_only_keys_inside_the_window():
    from megatron.core.transformer.attention_logits import max_attention_logits
    from megatron.core.transformer.attention import SelfAttention

    hidden = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(4))
    maxima = []
    for window in ((1, 0), None):
        tensor_parallel.model_parallel_cuda_manual_seed(3)
        attention = SelfAttention(tiny_config(window_size=window, log_max_attention_logit=True), layer_number=1)
        attention(hidden)
        maxima.append(attention.max_attention_logits)
    mixed = attention.linear_qkv(hidden)[0].view(SEQ, BATCH, HEADS, 3, HIDDEN // HEADS)
    blocked = window_blocked(torch.arange(SEQ), torch.arange(SEQ), (1, 0))
    expected = max_attention_logits(mixed[:, :, :, 0], mixed[:, :, :, 1], blocked)
    torch.testing.assert_close(maxima[0], expected)
    assert (maxima[1] > maxima[0] + 1e-4).any()  # keys outside the window held larger logits


def _tp2_equals_tp1(sequence_parallel):
    return reference_then_parallel(2, sequence_parallel, dict(window_size=(2, 0), window_attn_skip_freq=2,
                                                              softmax_type="learnable"), {})


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tp2_equals_tp1(sequence_parallel):
    for result in run_on_ranks(2, _tp2_equals_tp1, sequence_parallel):
        assert result["param_diff"] == 0.0
        assert result["loss_diff"] < 1e-6 and result["logits_diff"] < 1e-5, result
        assert result["grad_diff"] < 1e-6 * max(1.0, result["largest_grad"]), result


def _cp2_equals_cp1(window_size=(3, 0), softmax_type="vanilla"):
    """Loss and gradients of a GPT whose four layers use the four comm types (a2a+p2p as 2 x 1) at CP2 against
    the same weights at CP1; learnable sinks start from distinct values per head."""
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.context_parallel import local_rows
    from megatron.core.transformer.transformer_config import TransformerConfig

    seq, vocab = 16, 64
    cp_size, cp_rank = dist.get_world_size(), dist.get_rank()
    parallel_state.initialize_model_parallel(context_parallel_size=cp_size,
                                             hierarchical_context_parallel_sizes=[cp_size, 1])
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    try:
        def gpt(cp):
            config = TransformerConfig(num_layers=4, hidden_size=HIDDEN, num_attention_heads=HEADS,
                                       hidden_dropout=0.0, attention_dropout=0.0, init_seed=1234,
                                       context_parallel_size=cp,
                                       cp_comm_type=["p2p", "allgather", "a2a", "a2a+p2p"] if cp > 1 else "p2p",
                                       hierarchical_context_parallel_sizes=(cp, 1) if cp > 1 else None,
                                       window_size=window_size, softmax_type=softmax_type)
            return GPTModel(config, vocab_size=vocab, max_sequence_length=seq, position_embedding_type="rope",
                            share_embeddings_and_output_weights=True)

        stream = torch.randint(0, vocab, (BATCH, seq + 1), generator=torch.Generator().manual_seed(0))
        tokens, labels, positions = stream[:, :-1], stream[:, 1:], torch.arange(seq).expand(BATCH, -1)
        reference, model = gpt(1), gpt(cp_size)
        with torch.no_grad():
            for name, param in reference.named_parameters():
                if name.endswith("softmax_offset"):
                    param.copy_(torch.linspace(-1.0, 1.5, HEADS))
        model.load_state_dict(reference.state_dict())
        reference(tokens, positions, labels=labels).sum().backward()
        local = [local_rows(t, 1, cp_size, cp_rank) for t in (tokens, positions, labels)]
        losses = model(local[0], local[1], labels=local[2])
        loss = losses.detach().sum()
        losses.sum().backward()
        dist.all_reduce(loss)
        grad_error, sink_grads = 0.0, []
        for (name, param), expected in zip(model.named_parameters(), reference.parameters()):
            grad = param.grad.clone()
            dist.all_reduce(grad)
            grad_error = max(grad_error, (grad - expected.grad).abs().max().item())
            if name.endswith("softmax_offset"):
                sink_grads.append(expected.grad.abs().min().item())
        full = reference(tokens, positions, labels=labels).detach().sum()
        return loss.item(), full.item(), grad_error, sink_grads
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("window_size, softmax_type", [((3, 0), "vanilla"), ((3, 0), "learnable"),
                                                       (None, "learnable"), ((3, 0), "off-by-one")])
def test_window_and_sinks_under_context_parallelism_equal_cp1(window_size, softmax_type):
    for loss, reference, grad_error, sink_grads in run_on_ranks(2, _cp2_equals_cp1, window_size, softmax_type):
        assert abs(loss - reference) < 1e-5 * abs(reference) and grad_error < 1e-5, (loss, reference, grad_error)
        assert len(sink_grads) == (4 if softmax_type == "learnable" else 0)
        assert all(grad > 1e-7 for grad in sink_grads), sink_grads  # every layer's sinks are trained


WRAPPER_FLAGS = {
    "ddp": "",
    "distopt": "--use-distributed-optimizer",
    "mfsdp": "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params",
    "fsdp2": "--use-torch-fsdp2",
}


def _wrapper_losses(wrapper):
    import os

    from megatron.core.distributed import wrap_data_parallel
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.model_config import core_transformer_config_from_args, ddp_config_from_args
    from tests.unit_tests.distributed.precision_gpt import gpt_batch, gpt_loss

    flags = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 2 "
             "--train-iters 10 --lr 1e-3 --mock-data --vocab-size 64 --hidden-dropout 0 --attention-dropout 0 "
             "--untie-embeddings-and-output-weights --window-size (4,0) --window-attn-skip-freq 2 "
             "--softmax-type learnable " + WRAPPER_FLAGS[wrapper])
    os.environ.update({"WORLD_SIZE": str(dist.get_world_size()), "RANK": str(dist.get_rank())})
    args = validate_args(parse_args(args=flags.split()))
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    config = core_transformer_config_from_args(args)
    model = GPTModel(config, vocab_size=64, max_sequence_length=16, share_embeddings_and_output_weights=False)
    chunk = wrap_data_parallel(model.config, ddp_config_from_args(args), model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="sgd", lr=0.5, sgd_momentum=0.0, clip_grad=0.0,
                        use_distributed_optimizer=args.use_distributed_optimizer), [chunk])
    losses = []
    for step in range(3):
        optimizer.zero_grad()
        if hasattr(chunk, "zero_grad_buffer"):
            chunk.zero_grad_buffer()
        loss = gpt_loss(chunk, gpt_batch(step))
        loss.backward()
        chunk.finish_grad_sync()
        assert optimizer.step()[0]
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
    offsets = [name for name, _ in model.named_parameters() if name.endswith("softmax_offset")]
    state = {key: value for key, value in chunk.state_dict().items() if key.endswith("softmax_offset")}
    moved = [(value.full_tensor() if hasattr(value, "full_tensor") else value).abs().max().item()
             for value in state.values()]
    return losses, offsets, moved


def test_data_parallel_wrappers_train_the_sinks_alike():
    results = {wrapper: run_on_ranks(2, _wrapper_losses, wrapper)[0] for wrapper in WRAPPER_FLAGS}
    reference, reference_moved = results["ddp"][0], results["ddp"][2]
    assert min(reference_moved) > 1e-5, reference_moved  # the zero-initialised sinks were trained
    for wrapper, (losses, offsets, moved) in results.items():
        assert offsets == ["decoder.layers.0.self_attention.softmax_offset",
                           "decoder.layers.1.self_attention.softmax_offset"], (wrapper, offsets)
        torch.testing.assert_close(torch.tensor(moved), torch.tensor(reference_moved), rtol=1e-4, atol=0)
        for value, expected in zip(losses, reference, strict=True):
            assert abs(value - expected) <= 1e-6 * abs(expected), (wrapper, losses, reference)
    assert abs(reference[-1] - reference[0]) > 1e-3, reference


def _config_fields(**overrides):
    fields = dict(num_layers=4, hidden_size=HIDDEN, num_attention_heads=HEADS)
    fields.update(overrides)
    return fields


@pytest.mark.parametrize("overrides, message", [
    (dict(window_attn_skip_freq=2), "--window-attn-skip-freq chooses which layers skip the sliding window: it "
                                    "needs --window-size"),
    (dict(window_size=(4, 0), window_attn_skip_freq=[1, 0]), "needs one 0 or 1 per layer (4 for --num-layers)"),
    (dict(window_size=(4, 0), window_attn_skip_freq=0), "--window-attn-skip-freq must be >= 1"),
    (dict(window_size=(-2, 0)), "--window-size takes two integers (left, right), each >= 0 or -1"),
    (dict(window_size="8"), "--window-size takes two integers"),
    (dict(softmax_type="sigmoid"), "--softmax-type must be one of vanilla, off-by-one, learnable"),
])
def test_config_rules_name_the_flags(overrides, message):
    from megatron.core.transformer.transformer_config import TransformerConfig

    with pytest.raises(ValueError) as error:
        TransformerConfig(**_config_fields(**overrides))
    assert message in str(error.value)


def test_flags_reach_the_config(monkeypatch):
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.model_config import core_transformer_config_from_args

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    base = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--micro-batch-size", "2", "--train-iters", "2", "--lr", "1e-3", "--mock-data", "--vocab-size", "64"]
    default = core_transformer_config_from_args(validate_args(parse_args(args=base)))
    assert default.window_size is None and default.window_attn_skip_freq is None and default.softmax_type == "vanilla"
    args = validate_args(parse_args(args=base + ["--window-size", "(128, 0)", "--window-attn-skip-freq",
                                                 "([1]*3+[0]*1)", "--softmax-type", "learnable"]))
    config = core_transformer_config_from_args(args)
    assert config.window_size == (128, 0) and config.window_attn_skip_freq == (1, 1, 1, 0)
    assert config.softmax_type == "learnable"
    with pytest.raises(ValueError, match="--window-attn-skip-freq chooses which layers"):
        validate_args(parse_args(args=base + ["--window-attn-skip-freq", "2"]))


def test_checkpoint_records_and_hf_export_refusal(monkeypatch):
    from megatron.training.checkpoint_args import MODEL_ARGS, architecture_differences
    # The checkpoint tools import each other as scripts do, from their own directory.
    monkeypatch.syspath_prepend(os.path.join(REPOSITORY, "tools", "checkpoint"))
    from hf_unsupported import hf_export_problems

    assert {"window_size", "window_attn_skip_freq", "softmax_type"} <= set(MODEL_ARGS)
    saved = types.SimpleNamespace(num_layers=4, window_size=(8, 0), window_attn_skip_freq=2, softmax_type="learnable")
    same_layers = types.SimpleNamespace(num_layers=4, window_size=(8, 0), window_attn_skip_freq=[1, 0, 1, 0],
                                        softmax_type="learnable")
    assert architecture_differences(saved, same_layers) == []  # 2 and [1,0,1,0] are the same four layers
    other = types.SimpleNamespace(num_layers=4, window_size=None, window_attn_skip_freq=None, softmax_type="vanilla")
    differences = architecture_differences(saved, other)
    assert "--window-size: (8, 0) in the checkpoint, none in this run" in differences
    assert "--softmax-type: learnable in the checkpoint, vanilla in this run" in differences
    shifted = types.SimpleNamespace(num_layers=4, window_size=(8, 0), window_attn_skip_freq=3,
                                    softmax_type="learnable")
    assert architecture_differences(saved, shifted) == [
        "--window-attn-skip-freq: [1,0,1,0] in the checkpoint, [1,1,0,1] in this run"]
    problems = hf_export_problems(saved)
    assert any(p.startswith("--window-size (8, 0): sliding-window attention") for p in problems), problems
    assert any(p.startswith("--softmax-type learnable: attention sinks") for p in problems), problems
    assert hf_export_problems(other) == []


def test_decoding_through_the_cache_keeps_the_window_and_sinks():
    from megatron.core.inference.contexts.static_context import StaticInferenceContext

    attention, full, _ = _attention_and_reference(window_size=(2, 0), softmax_type="learnable")
    hidden = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(4))  # as the helper's
    context = StaticInferenceContext(max_batch_size=BATCH, max_sequence_length=SEQ)
    steps = []
    with torch.no_grad():
        for start, stop in ((0, 5), (5, 6), (6, 8)):  # a prompt, then one and two tokens at a time
            steps.append(attention(hidden[start:stop], inference_context=context)[0])
            context.increment_sequence_len_offset(stop - start)
    torch.testing.assert_close(torch.cat(steps), full.detach(), atol=1e-5, rtol=1e-5)
