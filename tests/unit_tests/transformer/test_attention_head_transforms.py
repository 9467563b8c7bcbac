"""NoPE layers (`--no-rope-freq`), the QK L2 norm (`--qk-l2-norm`) and the attention output gate
(`--attention-output-gate`): the layer pattern against upstream's rule, the layer against a reference written here
from the formulas (fused rows sliced by hand), TP2 against TP1, CP2 against CP1, decoding through the cache
against the whole sequence, and the rules, checkpoint records, HF export refusal, Muon split and FLOPs that follow
them."""

import argparse
import math
import os
import types

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.attention_head_transforms import no_rope_layer_pattern
from tests.unit_tests.models.gpt.gpt_test_utils import reference_then_parallel, tiny_config
from tests.unit_tests.multiprocess_harness import run_on_ranks

REPOSITORY = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

SEQ, BATCH, HEADS, GROUPS, HIDDEN = 6, 2, 4, 2, 32
HEAD_DIM = HIDDEN // HEADS
ALL_THREE = dict(no_rope_freq=2, qk_l2_norm=True, attention_output_gate=True)


def _summed(output_and_bias):
    """An attention's `(output, bias)` (upstream's return) -> output + bias, what the layer adds to the residual."""
    output, bias = output_and_bias
    return output if bias is None else output + bias


def test_no_rope_pattern_follows_upstream():
    # An int N: every N-th layer (1-based) skips RoPE; a list: 1 skips it.
    assert no_rope_layer_pattern(4, 8) == [False, False, False, True] * 2
    assert no_rope_layer_pattern(1, 2) == [True, True]
    assert no_rope_layer_pattern((0, 1, 1, 0), 4) == [False, True, True, False]
    assert no_rope_layer_pattern(None, 3) == [False] * 3


def _rope(x, positions):
    """Rotate-half RoPE on `[s, b, heads, d]`: channel i pairs with i + d/2 at angle p / 10000^(2i/d)."""
    half = x.shape[-1] // 2
    angles = positions[:, None].double() / 10000.0 ** (torch.arange(half).double() * 2 / x.shape[-1])
    cos, sin = angles.cos()[:, None, None, :], angles.sin()[:, None, None, :]
    first, second = x[..., :half], x[..., half:]
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


def _reference(attention, hidden, layer_number, positions):
    """The layer's output computed head by head in float64 from its weights (fused rows sliced by hand)."""
    config = attention.config
    m, d = HEADS // GROUPS, HEAD_DIM
    gated = config.attention_output_gate
    block = (2 * m + 2 if gated else m + 2) * d  # rows of one query group
    weight = attention.linear_qkv.weight.double()
    fused = hidden.double() @ weight.t() + attention.linear_qkv.bias.double()  # [s, b, rows]
    heads = []
    for head in range(HEADS):
        group, j = divmod(head, m)
        start = group * block
        query = fused[..., start + j * d:start + (j + 1) * d]
        key = fused[..., start + (2 * m if gated else m) * d:][..., :d]
        value = fused[..., start + (2 * m if gated else m) * d + d:][..., :d]
        if config.no_rope_freq is None or layer_number % config.no_rope_freq != 0:
            query, key = (_rope(t[:, :, None], positions)[:, :, 0] for t in (query, key))
        if config.qk_l2_norm:
            query, key = (t / (t.pow(2).mean(-1, keepdim=True) + config.layernorm_epsilon).sqrt()
                          for t in (query, key))
        scores = torch.einsum("ibd,jbd->bij", query, key) / math.sqrt(d)
        scores = scores.masked_fill(torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1), float("-inf"))
        context = torch.einsum("bij,jbd->ibd", scores.softmax(-1), value)
        if gated:
            context = context * torch.sigmoid(fused[..., start + m * d + j * d:start + m * d + (j + 1) * d])
        heads.append(context)
    context = torch.cat(heads, dim=-1)
    return context @ attention.linear_proj.weight.double().t() + attention.linear_proj.bias.double()


def _attention(layer_number=1, **overrides):
    from megatron.core.transformer.attention import SelfAttention

    tensor_parallel.model_parallel_cuda_manual_seed(3)
    config = tiny_config(num_query_groups=GROUPS, **overrides)
    attention = SelfAttention(config, layer_number=layer_number)
    with torch.no_grad():  # a visible bias (zero-initialised otherwise)
        attention.linear_qkv.bias.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(5))
    return attention


def _hidden():
    return torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(4))


@pytest.mark.parametrize("layer_number, overrides", [
    (2, dict(no_rope_freq=2)), (1, dict(no_rope_freq=2)), (1, dict(qk_l2_norm=True)),
    (1, dict(attention_output_gate=True)), (2, ALL_THREE), (1, ALL_THREE),
])
def test_self_attention_equals_the_reference(layer_number, overrides):
    hidden, angles = _hidden(), RotaryEmbedding(HEAD_DIM)(SEQ)
    attention = _attention(layer_number, **overrides)
    output, bias = attention(hidden, rotary_pos_emb=angles)  # (output, bias) as upstream
    output = output + bias
    expected = _reference(attention, hidden, layer_number, torch.arange(SEQ))
    torch.testing.assert_close(output.double(), expected, atol=1e-5, rtol=1e-5)
    plain = _attention(layer_number)
    if overrides == dict(no_rope_freq=2) and layer_number == 1:  # a layer that keeps RoPE: unchanged
        assert torch.equal(_summed(plain(hidden, rotary_pos_emb=angles)), output)
    elif not overrides.get("attention_output_gate"):  # same weights: the variant must change the result
        assert (_summed(plain(hidden, rotary_pos_emb=angles)) - output).abs().max() > 1e-3
    else:
        assert attention.linear_qkv.weight.shape == (2 * HIDDEN + 2 * GROUPS * HEAD_DIM, HIDDEN)


def test_l2_norm_keeps_the_activation_dtype():
    from megatron.core.transformer.attention_head_transforms import gate_attention_output, l2_normalize_heads

    heads = torch.randn(3, 2, 4, 8, generator=torch.Generator().manual_seed(0)).bfloat16()
    normalised = l2_normalize_heads(heads, 1e-6)
    assert normalised.dtype == torch.bfloat16
    expected = heads.double() / (heads.double().pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
    torch.testing.assert_close(normalised.double(), expected, atol=1e-2, rtol=1e-2)
    gated = gate_attention_output(heads.flatten(2), -heads.flatten(2))
    assert gated.dtype == torch.bfloat16


def test_decoding_through_the_cache_equals_the_whole_sequence():
    from megatron.core.inference.contexts.static_context import StaticInferenceContext

    hidden, rotary = _hidden(), RotaryEmbedding(HEAD_DIM)
    for layer_number in (1, 2):  # a RoPE layer and a NoPE layer
        attention = _attention(layer_number, **ALL_THREE)
        with torch.no_grad():
            full, _ = attention(hidden, rotary_pos_emb=rotary(SEQ))
            context = StaticInferenceContext(max_batch_size=BATCH, max_sequence_length=SEQ)
            steps = []
            for start, stop in ((0, 3), (3, 4), (4, 6)):  # a prompt, then one and two tokens at a time
                steps.append(attention(hidden[start:stop], rotary_pos_emb=rotary(stop - start, offset=start),
                                       inference_context=context)[0])
                context.increment_sequence_len_offset(stop - start)
        torch.testing.assert_close(torch.cat(steps), full, atol=1e-5, rtol=1e-5)


def _tp2_equals_tp1(sequence_parallel):
    return reference_then_parallel(2, sequence_parallel, dict(num_query_groups=GROUPS, **ALL_THREE),
                                   dict(position_embedding_type="rope"))


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tp2_equals_tp1(sequence_parallel):
    for result in run_on_ranks(2, _tp2_equals_tp1, sequence_parallel):
        assert result["param_diff"] == 0.0
        assert result["loss_diff"] < 1e-6 and result["logits_diff"] < 1e-5, result
        assert result["grad_diff"] < 1e-6 * max(1.0, result["largest_grad"]), result


def _cp2_equals_cp1():
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.context_parallel import local_rows
    from megatron.core.transformer.transformer_config import TransformerConfig

    seq, vocab = 16, 64
    cp_size, cp_rank = dist.get_world_size(), dist.get_rank()
    parallel_state.initialize_model_parallel(context_parallel_size=cp_size)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    try:
        def gpt(cp):
            config = TransformerConfig(num_layers=3, hidden_size=HIDDEN, num_attention_heads=HEADS,
                                       num_query_groups=GROUPS, hidden_dropout=0.0, attention_dropout=0.0,
                                       init_seed=1234, context_parallel_size=cp,
                                       cp_comm_type=["p2p", "allgather", "a2a"], no_rope_freq=[0, 1, 0],
                                       qk_l2_norm=True, attention_output_gate=True)
            return GPTModel(config, vocab_size=vocab, max_sequence_length=seq, position_embedding_type="rope",
                            share_embeddings_and_output_weights=True)

        stream = torch.randint(0, vocab, (BATCH, seq + 1), generator=torch.Generator().manual_seed(0))
        tokens, labels, positions = stream[:, :-1], stream[:, 1:], torch.arange(seq).expand(BATCH, -1)
        reference, model = gpt(1), gpt(cp_size)
        model.load_state_dict(reference.state_dict())
        reference(tokens, positions, labels=labels).sum().backward()
        local = [local_rows(t, 1, cp_size, cp_rank) for t in (tokens, positions, labels)]
        losses = model(local[0], local[1], labels=local[2])
        loss = losses.detach().sum()
        losses.sum().backward()
        dist.all_reduce(loss)
        grad_error = 0.0
        for param, expected in zip(model.parameters(), reference.parameters()):
            grad = param.grad.clone()
            dist.all_reduce(grad)
            grad_error = max(grad_error, (grad - expected.grad).abs().max().item())
        full = reference(tokens, positions, labels=labels).detach().sum()
        return loss.item(), full.item(), grad_error
    finally:
        parallel_state.destroy_model_parallel()


def test_context_parallelism_equals_cp1():
    for loss, reference, grad_error in run_on_ranks(2, _cp2_equals_cp1):
        assert abs(loss - reference) < 1e-5 * abs(reference) and grad_error < 1e-5, (loss, reference, grad_error)


@pytest.mark.parametrize("overrides, message", [
    (dict(no_rope_freq=3), "--no-rope-freq 3 must divide --num-layers 4"),
    (dict(no_rope_freq=0), "--no-rope-freq must be >= 1"),
    (dict(no_rope_freq=[0, 1]), "--no-rope-freq as a list needs one 0 or 1 per layer (4 for --num-layers"),
    (dict(no_rope_freq="[0,2,0,0]"), "needs one 0 or 1 per layer"),
    (dict(qk_l2_norm=True, qk_layernorm=True), "--qk-l2-norm and --qk-layernorm both normalise"),
    (dict(qk_l2_norm=True, qk_clip=True), "--qk-clip rescales the query and key weights, which --qk-l2-norm's"),
    (dict(attention_output_gate=True, qk_clip=True), "--qk-clip rescales the query and key rows of the fused QKV "
                                                     "weight as laid out without --attention-output-gate"),
    (dict(attention_output_gate=True, multi_latent_attention=True, kv_lora_rank=8, qk_head_dim=8,
          qk_pos_emb_head_dim=4, v_head_dim=8), "--attention-output-gate changes standard self-attention, which "
                                                "--multi-latent-attention replaces"),
])
def test_config_rules_name_the_flags(overrides, message):
    from megatron.core.transformer.transformer_config import TransformerConfig

    with pytest.raises(ValueError) as error:
        TransformerConfig(num_layers=4, hidden_size=HIDDEN, num_attention_heads=HEADS, **overrides)
    assert message in str(error.value)


BASE_FLAGS = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
              "--micro-batch-size", "2", "--train-iters", "2", "--lr", "1e-3", "--mock-data", "--vocab-size", "64"]


def test_flags_reach_the_config(monkeypatch):
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.model_config import core_transformer_config_from_args

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    default = core_transformer_config_from_args(validate_args(parse_args(args=BASE_FLAGS)))
    assert default.no_rope_freq is None and not default.qk_l2_norm and not default.attention_output_gate
    args = validate_args(parse_args(args=BASE_FLAGS + [
        "--position-embedding-type", "rope", "--no-rope-freq", "([0]*3+[1]*1)", "--qk-l2-norm",
        "--attention-output-gate"]))
    config = core_transformer_config_from_args(args)
    assert config.no_rope_freq == (0, 0, 0, 1) and config.qk_l2_norm and config.attention_output_gate
    with pytest.raises(ValueError, match="--no-rope-freq chooses which layers skip the rotary embedding: it needs "
                                         "--position-embedding-type rope"):
        validate_args(parse_args(args=BASE_FLAGS + ["--no-rope-freq", "2"]))


def test_checkpoint_records_and_hf_export_refusal(monkeypatch):
    from megatron.training.checkpoint_args import MODEL_ARGS, ArchitectureFlag, architecture_differences
    from megatron.training.checkpoint_args import ARCHITECTURE_FLAGS
    # The checkpoint tools import each other as scripts do, from their own directory.
    monkeypatch.syspath_prepend(os.path.join(REPOSITORY, "tools", "checkpoint"))
    from hf_unsupported import hf_export_problems

    assert {"no_rope_freq", "qk_l2_norm", "attention_output_gate"} <= set(MODEL_ARGS)
    rope = dict(num_layers=4, position_embedding_type="rope")
    saved = types.SimpleNamespace(**rope, no_rope_freq=2, qk_l2_norm=True, attention_output_gate=True)
    same = types.SimpleNamespace(**rope, no_rope_freq=[0, 1, 0, 1], qk_l2_norm=True, attention_output_gate=True)
    assert architecture_differences(saved, same) == []  # 2 and [0,1,0,1] are the same four layers
    plain = types.SimpleNamespace(**rope, no_rope_freq=None, qk_l2_norm=False, attention_output_gate=False)
    assert architecture_differences(saved, plain) == [
        "--no-rope-freq: [0,1,0,1] in the checkpoint, [0,0,0,0] in this run",
        "--qk-l2-norm: set in the checkpoint, not set in this run",
        "--attention-output-gate: set in the checkpoint, not set in this run"]
    flag = next(f for f in ARCHITECTURE_FLAGS if f.flag == "--no-rope-freq")
    assert isinstance(flag, ArchitectureFlag)
    assert flag.launch_with(saved) == '--no-rope-freq "[0,1,0,1]"'
    assert flag.launch_with(plain) == "no --no-rope-freq (every layer rotates)"
    older = types.SimpleNamespace(**rope)  # saved before the flags existed: nothing to compare
    assert architecture_differences(older, saved) == []
    problems = hf_export_problems(saved)
    assert [p.split(":")[0] for p in problems] == ["--no-rope-freq 2", "--qk-l2-norm", "--attention-output-gate"]
    assert hf_export_problems(plain) == []


def test_muon_splits_the_gate_rows_apart():
    from megatron.core.optimizer.muon import join_qkv_rows, split_qkv_rows
    from megatron.core.optimizer.muon_param_groups import fused_qkv_splits

    attention = _attention(attention_output_gate=True)
    split = fused_qkv_splits([attention])[id(attention.linear_qkv.weight)]
    weight = attention.linear_qkv.weight.detach()
    m, d = HEADS // GROUPS, HEAD_DIM
    assert split == (m * d, m * d, d, d)
    blocks = weight.view(GROUPS, (2 * m + 2) * d, HIDDEN)
    expected = [blocks[:, :m * d], blocks[:, m * d:2 * m * d], blocks[:, 2 * m * d:(2 * m + 1) * d],
                blocks[:, (2 * m + 1) * d:]]
    parts = split_qkv_rows(weight, split)
    for part, rows in zip(parts, expected, strict=True):
        assert torch.equal(part, rows.reshape(-1, HIDDEN))
    assert torch.equal(join_qkv_rows(parts, split), weight)
    plain = _attention()
    assert fused_qkv_splits([plain])[id(plain.linear_qkv.weight)] == (m * d, d, d)


def test_flops_estimate_counts_the_gate_rows():
    from megatron.training import training_log

    h, s, layers, batch = 64, 16, 2, 3
    values = dict(hidden_size=h, num_layers=layers, seq_length=s, kv_channels=16, num_attention_heads=4,
                  swiglu=False, ffn_hidden_size=256, padded_vocab_size=128)
    plain = training_log.training_flops_per_iteration(argparse.Namespace(**values), batch)
    gated = training_log.training_flops_per_iteration(argparse.Namespace(**values, attention_output_gate=True), batch)
    assert gated - plain == 3 * layers * 2 * h * (16 * 4) * s * batch
