"""Multi-latent attention: the layer against a plain-torch reference on the same weights (with and without a
query latent, RoPE and YaRN), YaRN's frequencies and mscale against hand-computed values, TP2 (with and without
sequence parallelism) against TP1, training through `pretrain()` under context, pipeline and data-parallel
layouts against the plain data-parallel run, and the errors bad flags give."""

import dataclasses
import math

import pytest
import torch

from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
    YarnRotaryEmbedding,
    yarn_correction_range,
    yarn_get_mscale,
)
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.corpus_data import write_corpus_prefix
from tests.unit_tests.dist_checkpointing.pretrain_helpers import pretrain_records
from tests.unit_tests.models.gpt.gpt_test_utils import reference_then_parallel
from tests.unit_tests.multiprocess_harness import run_on_ranks

TOLERANCE = 1e-5
NUM_DOCUMENTS = 100
SEQ, BATCH, HIDDEN, HEADS = 12, 2, 32, 4
SHAPE = dict(kv_lora_rank=12, qk_head_dim=6, qk_pos_emb_head_dim=16, v_head_dim=10)
YARN = dict(rotary_scaling_factor=4.0, mscale=1.0, mscale_all_dim=0.8, original_max_position_embeddings=256)
VARIANTS = {
    "no_query_latent_rope": dict(rope_type="rope"),
    "query_latent_yarn_rmsnorm": dict(q_lora_rank=10, qk_layernorm=True, normalization="RMSNorm", **YARN),
    "no_query_latent_yarn_layernorm": dict(qk_layernorm=True, add_bias_linear=False, **YARN),
}


def _summed(output_and_bias):
    """An attention's `(output, bias)` (upstream's return) -> output + bias, what the layer adds to the residual."""
    output, bias = output_and_bias
    return output if bias is None else output + bias


def mla_config(**overrides):
    fields = dict(num_layers=2, hidden_size=HIDDEN, num_attention_heads=HEADS, hidden_dropout=0.0,
                  attention_dropout=0.0, multi_latent_attention=True, **SHAPE)
    fields.update(overrides)
    return TransformerConfig(**fields)


# --------------------------------------------------------------------------------------------------------
# YaRN against hand-computed values
# --------------------------------------------------------------------------------------------------------


def test_yarn_frequencies_and_mscale_match_hand_computation():
    # 16 rotated channels, base 1e4, original context 256: the pair index that turns beta times over the context is
    # 16 ln(256 / (2 pi beta)) / (2 ln 1e4): 0.21 for beta_fast 32 (floor 0), 3.22 for beta_slow 1 (ceil 4).
    assert yarn_correction_range(32, 1, 16, 10000.0, 256) == (0, 4)
    yarn = YarnRotaryEmbedding(16, scaling_factor=4.0, original_max_position_embeddings=256, mscale=1.0,
                               mscale_all_dim=0.8)
    ramp = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.0, 1.0, 1.0])  # share of the frequency divided by s
    rope = 10000.0 ** (-torch.arange(8, dtype=torch.float64) / 8)
    expected = rope * (1 - ramp) + rope / 4.0 * ramp
    torch.testing.assert_close(yarn.inverse_frequencies().double(), expected, rtol=1e-6, atol=0)
    assert yarn_get_mscale(4.0, 0.8) == pytest.approx(0.08 * math.log(4.0) + 1)
    assert yarn_get_mscale(1.0, 0.8) == 1.0
    assert yarn.cos_sin_scale == pytest.approx((0.1 * math.log(4.0) + 1) / (0.08 * math.log(4.0) + 1))
    # Scaling factor 1 is plain RoPE.
    plain = YarnRotaryEmbedding(16, scaling_factor=1.0, mscale=0.5, mscale_all_dim=0.9)
    torch.testing.assert_close(plain.inverse_frequencies().double(), rope, rtol=1e-6, atol=0)
    assert plain.cos_sin_scale == 1.0


# --------------------------------------------------------------------------------------------------------
# The layer against plain torch on the same weights
# --------------------------------------------------------------------------------------------------------


def _reference_inverse_frequencies(config):
    """RoPE's frequencies, or YaRN's from the correction range computed here (see the hand-computed test)."""
    rot = config.qk_pos_emb_head_dim
    rope = 1.0 / config.rotary_base ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot)
    if config.effective_rope_type == "rope":
        return rope, 1.0, 1.0
    s = config.rotary_scaling_factor

    def turning_pair(rotations):
        return rot * math.log(config.original_max_position_embeddings / (2 * math.pi * rotations)) / (
            2 * math.log(config.rotary_base))

    low, high = max(math.floor(turning_pair(32)), 0), min(math.ceil(turning_pair(1)), rot - 1)
    ramp = ((torch.arange(rot // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    mscale = 0.1 * config.mscale * math.log(s) + 1
    mscale_all = 0.1 * config.mscale_all_dim * math.log(s) + 1
    return rope * (1 - ramp) + rope / s * ramp, mscale / mscale_all, mscale_all**2


def _rotate_pairs(x, angles, magnitude):
    """Channel pairs (2i, 2i + 1) as complex numbers times magnitude * e^(i angle)."""
    pairs = torch.view_as_complex(x.double().reshape(*x.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(pairs * torch.polar(torch.full_like(angles, magnitude), angles)).flatten(-2)


def _norm(config, x, weight, bias):
    if config.normalization == "RMSNorm":
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.layernorm_epsilon) * weight
    centred = x - x.mean(-1, keepdim=True)
    return centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + config.layernorm_epsilon) * weight + bias


def _reference_mla(config, weights, x):
    """Multi-latent attention in float64 with plain torch ops; `weights` are the layer's, by parameter name."""
    n, dn, dr, dv = HEADS, config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim
    seq, batch = x.shape[0], x.shape[1]
    if config.q_lora_rank is None:
        q = x @ weights["linear_q_proj.weight"].T
    else:
        q_latent = x @ weights["linear_q_down_proj.weight"].T
        if config.qk_layernorm:
            q_latent = _norm(config, q_latent, weights["q_layernorm.weight"], weights.get("q_layernorm.bias"))
        q = q_latent @ weights["linear_q_up_proj.weight"].T
    q = q.reshape(seq, batch, n, dn + dr)
    compressed = x @ weights["linear_kv_down_proj.weight"].T
    kv_latent, k_rope = compressed[..., :config.kv_lora_rank], compressed[..., config.kv_lora_rank:]
    if config.qk_layernorm:
        kv_latent = _norm(config, kv_latent, weights["kv_layernorm.weight"], weights.get("kv_layernorm.bias"))
    kv = (kv_latent @ weights["linear_kv_up_proj.weight"].T).reshape(seq, batch, n, dn + dv)
    inverse_frequencies, cos_sin_scale, softmax_correction = _reference_inverse_frequencies(config)
    angles = torch.outer(torch.arange(seq, dtype=torch.float64), inverse_frequencies)[:, None, None, :]
    q_rope = _rotate_pairs(q[..., dn:], angles, cos_sin_scale)
    k_rope = _rotate_pairs(k_rope[:, :, None, :], angles, cos_sin_scale).expand(seq, batch, n, dr)
    query = torch.cat((q[..., :dn], q_rope), -1).permute(1, 2, 0, 3)  # [b, n, s, dn + dr]
    key = torch.cat((kv[..., :dn], k_rope), -1).permute(1, 2, 0, 3)
    value = kv[..., dn:].permute(1, 2, 0, 3)
    scores = query @ key.transpose(-1, -2) * softmax_correction / math.sqrt(dn + dr)
    causal = torch.ones(seq, seq, dtype=torch.bool).triu(1)
    context = torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1) @ value  # [b, n, s, dv]
    context = context.permute(2, 0, 1, 3).reshape(seq, batch, n * dv)
    out = context @ weights["linear_proj.weight"].T
    return out + weights["linear_proj.bias"] if "linear_proj.bias" in weights else out


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_layer_matches_plain_torch_reference(variant):
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    config = mla_config(init_method_std=0.3, **VARIANTS[variant])  # outputs of order 1, not 1e-3
    layer = MLASelfAttention(config, layer_number=1)
    with torch.no_grad():  # non-trivial norm weights and biases
        for name, param in layer.named_parameters():
            if "layernorm" in name or name.endswith("bias"):
                param.add_(0.1 * torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))))
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=generator, requires_grad=True)
    upstream_grad = torch.randn(SEQ, BATCH, HIDDEN, generator=generator)
    out = _summed(layer(x))  # (output, bias) as upstream
    out.backward(upstream_grad)

    weights = {name: p.detach().double().requires_grad_() for name, p in layer.named_parameters()}
    x_reference = x.detach().double().requires_grad_()
    reference = _reference_mla(config, weights, x_reference)
    reference.backward(upstream_grad.double())

    assert out.abs().max() > 0.5
    torch.testing.assert_close(out.double(), reference, rtol=0, atol=TOLERANCE)
    torch.testing.assert_close(x.grad.double(), x_reference.grad, rtol=0, atol=TOLERANCE)
    for name, param in layer.named_parameters():
        assert weights[name].grad.abs().max() > 1e-4, name
        torch.testing.assert_close(param.grad.double(), weights[name].grad, rtol=0, atol=TOLERANCE, msg=name)


def test_fp16_query_key_layer_scaling_keeps_the_mla_softmax_scale():
    """fp16 under --apply-query-key-layer-scaling (scores divided by the layer number in fp16, multiplied back in
    fp32) is the same attention: against the float64 reference within fp16 rounding (~1e-3 per operand; 2e-2 on
    outputs of order 1 leaves room for the chain of five fp16 GEMMs), and the YaRN mscale^2 must be kept (it
    moves the output by ~0.1 here)."""
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    config = mla_config(init_method_std=0.3, fp16=True, params_dtype=torch.float16,
                        apply_query_key_layer_scaling=True, **VARIANTS["no_query_latent_yarn_layernorm"])
    layer = MLASelfAttention(config, layer_number=3)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        out = _summed(layer(x.half())).double()
    weights = {name: p.detach().double() for name, p in layer.named_parameters()}
    reference = _reference_mla(config, weights, x.half().double())
    without_mscale = _reference_mla(dataclasses.replace(config, mscale_all_dim=0.0), weights, x.half().double())
    assert (reference - without_mscale).abs().max() > 0.05
    torch.testing.assert_close(out, reference, rtol=0, atol=2e-2)


# --------------------------------------------------------------------------------------------------------
# Tensor parallelism: TP2 (with and without sequence parallelism) equals TP1
# --------------------------------------------------------------------------------------------------------


def _tp2_and_tp2_sequence_parallel(config_overrides):
    results = []
    for sequence_parallel in (False, True):
        parallel_state.destroy_model_parallel()
        results.append(reference_then_parallel(2, sequence_parallel, config_overrides,
                                               {"position_embedding_type": "rope"}))
    return results


@pytest.mark.parametrize("world_size", [2])
def test_tp2_matches_tp1_with_and_without_sequence_parallel(world_size):
    overrides = dict(multi_latent_attention=True, **SHAPE, **VARIANTS["query_latent_yarn_rmsnorm"])
    for results in run_on_ranks(world_size, _tp2_and_tp2_sequence_parallel, overrides):
        for result in results:
            assert result["param_diff"] == 0.0, "initial weights must not depend on the tensor-parallel size"
            assert result["largest_grad"] > 1e-3
            for key in ("loss_diff", "logits_diff", "grad_diff"):
                assert result[key] < TOLERANCE, (key, result)


# --------------------------------------------------------------------------------------------------------
# Training through pretrain(): layouts against plain data parallelism
# --------------------------------------------------------------------------------------------------------

MLA_GPT = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
    "--multi-latent-attention --q-lora-rank 12 --kv-lora-rank 8 --qk-head-dim 6 --qk-pos-emb-head-dim 4 "
    "--v-head-dim 10 --qk-layernorm --normalization RMSNorm --swiglu --position-embedding-type rope "
    "--rotary-scaling-factor 4 --mscale-all-dim 0.8 --original-max-position-embeddings 8 "
    "--untie-embeddings-and-output-weights --hidden-dropout 0 --attention-dropout 0 --micro-batch-size 2 "
    "--global-batch-size 8 --lr 1e-2 --lr-decay-style constant --train-iters 4 --seed 1234 "
    "--tokenizer-type ByteLevelTokenizer --make-vocab-size-divisible-by 64 --split 100,0,0 --num-workers 0 "
    "--log-interval 100 --eval-iters 0 --distributed-backend gloo"
)
LAYOUTS = {
    "cp2_p2p_a2a_megatron_fsdp_z3": "--context-parallel-size 2 --cp-comm-type p2p a2a --use-megatron-fsdp",
    "pp2_fsdp2": "--pipeline-model-parallel-size 2 --use-torch-fsdp2",
}


def _pretrain_losses(corpus_prefix, workdir, layout):
    records = pretrain_records(workdir, f"{MLA_GPT} --data-path {corpus_prefix} {layout}")
    return {record["iteration"]: record["lm loss"] for record in records}


def _trained_losses(corpus_prefix, workdir):
    return {name: _pretrain_losses(corpus_prefix, workdir, layout)
            for name, layout in (("dp2_ddp", ""), *LAYOUTS.items())}


@pytest.mark.parametrize("world_size", [2])
def test_mla_gpt_trains_alike_under_cp_pp_and_each_wrapper(tmp_path, world_size):
    corpus_prefix = write_corpus_prefix(tmp_path, NUM_DOCUMENTS)
    losses = run_on_ranks(world_size, _trained_losses, corpus_prefix, str(tmp_path))[0]
    reference = losses.pop("dp2_ddp")
    values = [reference[i] for i in sorted(reference)]
    assert sorted(reference) == list(range(1, 5))
    assert all(math.isfinite(v) for v in values) and values[-1] < values[0] - 0.5, values
    for name, layout_losses in losses.items():
        assert sorted(layout_losses) == sorted(reference), name
        for iteration, loss in reference.items():
            assert abs(layout_losses[iteration] - loss) <= TOLERANCE * abs(loss), (name, iteration)


# --------------------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, flag", [
    (dict(kv_lora_rank=None), "--kv-lora-rank"),
    (dict(qk_head_dim=None), "--qk-head-dim"),
    (dict(v_head_dim=0), "--v-head-dim"),
    (dict(qk_pos_emb_head_dim=5), "--qk-pos-emb-head-dim"),
    (dict(q_lora_rank=-1), "--q-lora-rank"),
    (dict(num_query_groups=2), "--group-query-attention"),
    (dict(rope_type="rope", rotary_scaling_factor=2.0), "--rotary-scaling-factor"),
    (dict(rope_type="ntk"), "--rope-type"),
    (dict(multi_latent_attention=False), "--kv-lora-rank"),
    (dict(multi_latent_attention=False, kv_lora_rank=None, qk_head_dim=None, qk_pos_emb_head_dim=None,
          v_head_dim=None, rope_type="yarn"), "--rope-type yarn"),
])
def test_bad_config_names_the_flag(overrides, flag):
    with pytest.raises(ValueError, match=flag):
        mla_config(**overrides)


@pytest.mark.parametrize("extra, flag", [
    ("--kv-lora-rank 16", "--kv-lora-rank"),
    ("--rotary-scaling-factor 2", "--rotary-scaling-factor"),
    ("--multi-latent-attention --rope-type rope --mscale 0.5", "--mscale"),
    ("--multi-latent-attention --rope-type rope --original-max-position-embeddings 64",
     "--original-max-position-embeddings"),
    ("--multi-latent-attention --rotary-percent 0.5", "--rotary-percent"),
    ("--rope-type rope", "--position-embedding-type rope"),
])
def test_bad_flags_name_the_flag(extra, flag):
    from megatron.training.arguments import parse_args, validate_args

    argv = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 2 "
            f"--global-batch-size 4 --train-iters 2 --lr 1e-3 --mock-data --vocab-size 64 {extra}").split()
    with pytest.raises(ValueError, match=flag):
        validate_args(parse_args(args=argv))


def test_flags_reach_the_config():
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.model_config import core_transformer_config_from_args

    argv = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 2 "
            "--global-batch-size 4 --train-iters 2 --lr 1e-3 --mock-data --vocab-size 64 --multi-latent-attention "
            "--rotary-base 500 --rotary-scaling-factor 40 --mscale 0.7 --mscale-all-dim 0.7").split()
    config = core_transformer_config_from_args(validate_args(parse_args(args=argv)))
    assert (config.q_lora_rank, config.kv_lora_rank, config.qk_head_dim, config.qk_pos_emb_head_dim,
            config.v_head_dim) == (None, 32, 128, 64, 128)  # upstream's defaults
    assert (config.effective_rope_type, config.rotary_base, config.rotary_scaling_factor, config.mscale,
            config.mscale_all_dim, config.original_max_position_embeddings) == ("yarn", 500, 40.0, 0.7, 0.7, 4096)
    plain = core_transformer_config_from_args(validate_args(parse_args(args=argv[:-9])))
    assert not plain.multi_latent_attention and plain.kv_lora_rank is None


def test_checkpoint_of_another_mla_model_is_refused_naming_the_flags():
    from argparse import Namespace

    from megatron.training.checkpoint_args import architecture_differences

    mla = dict(multi_latent_attention=True, qk_head_dim=8, qk_pos_emb_head_dim=8, rope_type=None,
               rotary_scaling_factor=40.0, mscale=1.0, mscale_all_dim=1.0)
    saved = Namespace(**mla)
    assert architecture_differences(saved, Namespace(**mla)) == []
    other = Namespace(**dict(mla, qk_head_dim=12, qk_pos_emb_head_dim=4, rope_type="rope", rotary_scaling_factor=1.0))
    assert [phrase.split(":")[0] for phrase in architecture_differences(saved, other)] == [
        "--qk-head-dim", "--qk-pos-emb-head-dim", "--rope-type", "--rotary-scaling-factor"]
    assert architecture_differences(saved, Namespace(multi_latent_attention=False)) == [
        "--multi-latent-attention: set in the checkpoint, not set in this run"]


def test_throughput_flops_count_the_latent_projections():
    from argparse import Namespace

    from megatron.training.training_log import training_flops_per_iteration

    args = Namespace(hidden_size=64, num_layers=2, seq_length=16, num_attention_heads=4, kv_channels=16,
                     num_query_groups=4, swiglu=False, ffn_hidden_size=256, padded_vocab_size=128,
                     multi_latent_attention=True, q_lora_rank=24, kv_lora_rank=32, qk_head_dim=8,
                     qk_pos_emb_head_dim=4, v_head_dim=12)
    # Per token and layer: q down 64x24, its norm (24) and up 24x(4*12); kv down 64x(32+4), its norm (32) and up
    # 32x(4*20); scores over 16 keys of 4*12 channels and the weighted sum of 4*12 value channels, both halved by
    # the causal mask; out 48x64. MLP 2 x 64x256, logits 64x128 (upstream's num_floating_point_operations).
    attention = 2 * (64 * 24 + 24 * 48 + 24 + 64 * 36 + 32 * 80 + 32 + 16 * 48 // 2 + 16 * 48 // 2 + 48 * 64)
    per_token = 2 * attention + 2 * 2 * (2 * 64 * 256) + 2 * 64 * 128
    assert training_flops_per_iteration(args, global_batch_size=3) == 3 * per_token * 16 * 3
