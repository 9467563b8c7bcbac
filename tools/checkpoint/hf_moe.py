"""The Mixture-of-Experts part of a Hugging Face Mixtral, Qwen2-MoE or Qwen3-MoE model, both ways: its config.json
keys (experts, top-k, renormalisation, which layers have experts, the shared expert) and the tensors of one MoE
layer (router, experts, shared expert and its gate).

Our names (megatron/core/transformer/moe/): `mlp.router.weight` `[experts, hidden]`,
`mlp.experts.local_experts.{e}.linear_fc1.weight` (SwiGLU gate and up rows interleaved, as the dense MLP's) and
`.linear_fc2.weight` for expert e under its global index, `mlp.shared_experts.linear_fc1 / linear_fc2.weight` and
`mlp.shared_experts.gate_weight` `[1, hidden]`. HF's: Mixtral's `block_sparse_moe.gate.weight` and
`block_sparse_moe.experts.{e}.w1 / w3 / w2.weight` (gate, up, down); Qwen-MoE's `mlp.gate.weight`,
`mlp.experts.{e}.gate_proj / up_proj / down_proj.weight`, `mlp.shared_expert.*` and
`mlp.shared_expert_gate.weight` (Qwen2-MoE only).

Which layers have experts: HF's Qwen-MoE layer i does where i is not in `mlp_only_layers` and `decoder_sparse_step`
divides i + 1; ours where --moe-layer-freq says (an int N: layers 0, N, 2N, ..., else one 0/1 per layer), so the
import writes the pattern out as a list. Written back, the pattern becomes the largest step that divides i + 1 of
every MoE layer and the layers it would add as `mlp_only_layers`, unless the import recorded keys that give the
same layers (then those).
"""

import math
from typing import Dict, Optional

import torch

from hf_errors import ConversionError
from hf_families import MIXTRAL, QWEN2_MOE
from hf_layouts import fuse_gate_up, split_gate_up
from hf_shape import ModelShape

# config.json keys that change nothing our model computes, which an import records and an export writes back.
# Mixtral's router_jitter_noise is one of them: HF multiplies the input of the router and of the experts by
# uniform(1 - eps, 1 + eps) noise in training; --moe-input-jitter-eps jitters the router's only, so a run that wants
# jitter chooses it itself.
RECORDED_CONFIG_KEYS = ("router_aux_loss_coef", "output_router_logits", "decoder_sparse_step", "mlp_only_layers",
                        "router_jitter_noise")
# transformers' defaults of the training-only keys, for a model that was not imported.
_TRAINING_ONLY_DEFAULTS = {"router_aux_loss_coef": 0.001, "output_router_logits": False}


def layers_with_experts(num_layers: int, sparse_step: int, mlp_only_layers) -> list:
    """HF Qwen-MoE's choice: one bool per layer."""
    return [index not in mlp_only_layers and (index + 1) % sparse_step == 0 for index in range(num_layers)]


def sparse_step_and_dense_layers(pattern, recorded: Optional[dict] = None):
    """(decoder_sparse_step, mlp_only_layers) that give `pattern` (one bool per layer, at least one True):
    `recorded`'s where they give it, else the largest step and the layers it would add."""
    recorded = recorded or {}
    step, dense = recorded.get("decoder_sparse_step"), recorded.get("mlp_only_layers")
    if isinstance(step, int) and step > 0 and isinstance(dense, list) and \
            layers_with_experts(len(pattern), step, dense) == list(pattern):
        return step, dense
    step = math.gcd(*(index + 1 for index, moe in enumerate(pattern) if moe))
    return step, [index for index, moe in enumerate(pattern) if (index + 1) % step == 0 and not moe]


def hf_moe_config(shape: ModelShape, architecture: str, recorded: Optional[dict] = None) -> dict:
    """The Mixture-of-Experts keys of config.json (`recorded`: the keys an import kept)."""
    recorded = recorded or {}
    keys = {key: recorded.get(key, default) for key, default in _TRAINING_ONLY_DEFAULTS.items()}
    keys["num_experts_per_tok"] = shape.moe_router_topk
    if architecture == MIXTRAL:
        return {**keys, "num_local_experts": shape.num_experts, "intermediate_size": shape.moe_ffn_hidden_size,
                "router_jitter_noise": recorded.get("router_jitter_noise", 0.0)}
    step, dense = sparse_step_and_dense_layers(shape.moe_layers, recorded)
    keys.update(num_experts=shape.num_experts, moe_intermediate_size=shape.moe_ffn_hidden_size,
                norm_topk_prob=not shape.moe_router_pre_softmax, decoder_sparse_step=step, mlp_only_layers=dense)
    if architecture == QWEN2_MOE:
        keys.update(shared_expert_intermediate_size=shape.moe_shared_expert_intermediate_size,
                    qkv_bias=shape.add_qkv_bias)
    return keys


def moe_flags_of_config(config: dict, architecture: str, num_layers: int, path: str) -> dict:
    """Our MoE flags (ModelShape fields, ffn_hidden_size for Mixtral) of a Mixtral / Qwen-MoE config.json;
    ConversionError naming the key our MoE layers cannot compute as HF does."""
    experts = config.get("num_local_experts" if architecture == MIXTRAL else "num_experts",
                         config.get("num_local_experts"))
    topk = config.get("num_experts_per_tok")
    if not isinstance(experts, int) or experts <= 0 or not isinstance(topk, int) or not 0 < topk <= experts:
        raise ConversionError(f"{path}: config.json's num_experts / num_local_experts ({experts!r}) and "
                              f"num_experts_per_tok ({topk!r}) must be positive, the second at most the first")
    if architecture == MIXTRAL:
        jitter = config.get("router_jitter_noise") or 0.0
        if isinstance(jitter, bool) or not isinstance(jitter, (int, float)) or jitter < 0:
            raise ConversionError(f"{path}: router_jitter_noise {jitter!r} must be a number >= 0")
        renormalised, pattern = True, [True] * num_layers
        width = config.get("intermediate_size")
        flags = {"ffn_hidden_size": width}
    else:
        renormalised = bool(config.get("norm_topk_prob", False))
        step, dense = config.get("decoder_sparse_step", 1), config.get("mlp_only_layers") or []
        if not isinstance(step, int) or step <= 0:
            raise ConversionError(f"{path}: decoder_sparse_step {step!r} must be a positive integer")
        pattern = layers_with_experts(num_layers, step, dense)
        if not any(pattern):
            raise ConversionError(f"{path}: decoder_sparse_step {step} and mlp_only_layers {dense} leave no layer "
                                  f"with experts among {num_layers}: import it as a dense model "
                                  f"({architecture.replace('Moe', '')}) instead")
        width = config.get("moe_intermediate_size")
        flags = {}
    if not isinstance(width, int) or width <= 0:
        key = "intermediate_size" if architecture == MIXTRAL else "moe_intermediate_size"
        raise ConversionError(f"{path}: config.json's {key} ({width!r}) must be a positive integer")
    if topk == 1 and renormalised:
        key = "num_experts_per_tok 1" + ("" if architecture == MIXTRAL else " with norm_topk_prob true")
        raise ConversionError(f"{path}: {key}: every token's one expert gets probability 1, which our softmax router "
                              "does not compute (top-1 softmax routing needs --moe-router-pre-softmax, the "
                              "probability itself; that is norm_topk_prob false)")
    flags.update(num_experts=experts, moe_ffn_hidden_size=width, moe_router_topk=topk,
                 moe_layer_freq=1 if all(pattern) else [int(moe) for moe in pattern],
                 moe_router_pre_softmax=not renormalised)
    if architecture == QWEN2_MOE:
        shared = config.get("shared_expert_intermediate_size")
        if not isinstance(shared, int) or shared <= 0:
            raise ConversionError(f"{path}: shared_expert_intermediate_size {shared!r} must be a positive integer "
                                  "(Qwen2-MoE's shared expert is --moe-shared-expert-intermediate-size)")
        flags.update(moe_shared_expert_intermediate_size=shared, moe_shared_expert_gate=True)
    return flags


def _swiglu_mlps(shape: ModelShape, architecture: str, ours: str, theirs: str):
    """(our prefix, (HF gate, up, down weight names), width) of each expert and the shared expert of a layer."""
    for expert in range(shape.num_experts):
        our_prefix = f"{ours}mlp.experts.local_experts.{expert}."
        if architecture == MIXTRAL:
            prefix = f"{theirs}block_sparse_moe.experts.{expert}."
            yield our_prefix, (prefix + "w1.weight", prefix + "w3.weight", prefix + "w2.weight"), \
                shape.moe_ffn_hidden_size
        else:
            prefix = f"{theirs}mlp.experts.{expert}."
            yield our_prefix, tuple(f"{prefix}{name}_proj.weight" for name in ("gate", "up", "down")), \
                shape.moe_ffn_hidden_size
    if shape.moe_shared_expert_intermediate_size:
        yield f"{ours}mlp.shared_experts.", tuple(f"{theirs}mlp.shared_expert.{name}_proj.weight"
                                                  for name in ("gate", "up", "down")), \
            shape.moe_shared_expert_intermediate_size


def _gates(shape: ModelShape, architecture: str, ours: str, theirs: str):
    """(our name, HF name, rows) of the router and the shared expert's gate."""
    router = f"{theirs}block_sparse_moe.gate.weight" if architecture == MIXTRAL else f"{theirs}mlp.gate.weight"
    yield f"{ours}mlp.router.weight", router, shape.num_experts
    if shape.moe_shared_expert_gate:
        yield f"{ours}mlp.shared_experts.gate_weight", f"{theirs}mlp.shared_expert_gate.weight", 1


def moe_layer_from_hf(take, shape: ModelShape, architecture: str, ours: str, theirs: str) -> Dict[str, torch.Tensor]:
    """Our tensors of one MoE layer; `take(name, shape)` hands out (and checks) HF's tensors."""
    hidden, model = shape.hidden_size, {}
    for our_name, hf_name, rows in _gates(shape, architecture, ours, theirs):
        model[our_name] = take(hf_name, (rows, hidden))
    for our_prefix, (gate, up, down), width in _swiglu_mlps(shape, architecture, ours, theirs):
        model[our_prefix + "linear_fc1.weight"] = fuse_gate_up(take(gate, (width, hidden)), take(up, (width, hidden)))
        model[our_prefix + "linear_fc2.weight"] = take(down, (hidden, width))
    return model


def moe_layer_to_hf(take, shape: ModelShape, architecture: str, ours: str, theirs: str) -> Dict[str, torch.Tensor]:
    """HF's tensors of one MoE layer; `take(name, shape)` hands out (and checks) ours."""
    hidden, hf = shape.hidden_size, {}
    for our_name, hf_name, rows in _gates(shape, architecture, ours, theirs):
        hf[hf_name] = take(our_name, (rows, hidden))
    for our_prefix, (gate, up, down), width in _swiglu_mlps(shape, architecture, ours, theirs):
        hf[gate], hf[up] = split_gate_up(take(our_prefix + "linear_fc1.weight", (2 * width, hidden)))
        hf[down] = take(our_prefix + "linear_fc2.weight", (hidden, width))
    return hf
