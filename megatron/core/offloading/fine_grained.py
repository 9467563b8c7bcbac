"""Fine-grained activation offloading (`--fine-grained-activation-offloading --offload-modules ...`): the tensors
that chosen pieces of every transformer layer save for their backward pass go to host memory during the forward
pass and come back for the backward, through the block's `ActivationOffloader` (a multi-token-prediction
depth's layer through its own).

The pieces, in the order a layer's forward pass runs them:
- `attn_norm`: the input layernorm (`input_layernorm`);
- `qkv_linear`: the QKV projection (`linear_qkv`; with multi-latent attention the query and key-value
  projections, `linear_q_proj` or `linear_q_down_proj` / `linear_q_up_proj`, and `linear_kv_down_proj` /
  `linear_kv_up_proj`);
- `core_attn`: the core attention (`core_attention`, a method: its call site runs under
  `offloaded_saved_tensors`);
- `attn_proj`: the attention output projection (`linear_proj`);
- `mlp_norm`: the pre-MLP layernorm (`pre_mlp_layernorm`);
- `expert_fc1`: the routed experts' first linear and `moe_act` the experts' activation (function calls inside
  the expert modules: their call sites run under `offloaded_saved_tensors`); MoE layers only.

Modules get forward pre/post hooks that enter and leave the offloader's saved-tensor hooks around their forward;
function calls run under a context looked up by the piece's name. Each piece of each layer offloads under its own
label `(layer_number, piece)`, so labels follow the forward order and the offloader's prefetch reloads the piece
whose backward runs next. Everything a piece saves goes (its input and what its operations keep), except weights
and tensors below the offloader's size threshold. Nothing happens in evaluation or without gradients.

Under Transformer Engine's fused LayerNorm-linears the layer's norms run inside the QKV linear and (dense layers)
the MLP's fc1: `attn_norm` / `mlp_norm` then have nothing of their own there, and the input norm's saved tensors go
with `qkv_linear`.
"""

import contextlib

import torch

OFFLOADABLE_MODULES = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act")
EXPERT_MODULES = ("expert_fc1", "moe_act")

_QKV_PROJECTIONS = ("linear_qkv", "linear_q_proj", "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj",
                    "linear_kv_up_proj")
_PIECES_ATTRIBUTE = "offloaded_pieces"


def _hooked_modules(layer, piece):
    """The modules whose forward is the piece `piece` of `layer` (none where the layer lacks the sublayer: a hybrid
    model's Mamba, attention-only or MLP-only layers)."""
    attention = getattr(layer, "self_attention", None)
    if piece in ("attn_norm", "qkv_linear", "attn_proj") and attention is None:
        return []
    if piece == "attn_norm":
        return [] if layer.norms_fused_into_linears else [layer.input_layernorm]
    if piece == "qkv_linear":
        return [getattr(attention, name) for name in _QKV_PROJECTIONS if hasattr(attention, name)]
    if piece == "attn_proj":
        # A heterogeneous layer's linear stand-in (`linear_attn`) has no output projection.
        return [attention.linear_proj] if hasattr(attention, "linear_proj") else []
    if piece == "mlp_norm" and getattr(layer, "mlp", None) is not None:
        return [] if layer.norms_fused_into_mlp else [layer.pre_mlp_layernorm]
    return []


def _call_site_owners(layer, piece):
    """The modules whose forward calls the piece `piece` of `layer` as a function."""
    if piece == "core_attn":
        attention = getattr(layer, "self_attention", None)
        return [] if attention is None else [attention]
    experts = getattr(getattr(layer, "mlp", None), "experts", None)  # MoE layers only
    if piece in EXPERT_MODULES and experts is not None:
        return [experts]
    return []


class _OffloadRegion:
    """The saved tensors of one piece of one layer, offloaded under `label` while its module trains."""

    def __init__(self, offloader, label):
        self.offloader = offloader
        self.label = label

    def context(self, module):
        if not (module.training and torch.is_grad_enabled()):
            return contextlib.nullcontext()
        return self.offloader.hooks(self.label)


class _ForwardHooks:
    """Forward pre/post hooks that hold a region's context open during a module's forward."""

    def __init__(self, region):
        self.region = region
        self.open_contexts = []

    def enter(self, module, args):
        context = self.region.context(module)
        context.__enter__()
        self.open_contexts.append(context)

    def leave(self, module, args, output):
        self.open_contexts.pop().__exit__(None, None, None)


def attach_fine_grained_offloading(layer, offloader, pieces):
    """Offload what the pieces `pieces` (names of `OFFLOADABLE_MODULES`) of the transformer `layer` save for
    backward through `offloader`, each under the label `(layer.layer_number, piece)`."""
    for piece in pieces:
        region = _OffloadRegion(offloader, (layer.layer_number, piece))
        for module in _hooked_modules(layer, piece):
            hooks = _ForwardHooks(region)
            module.register_forward_pre_hook(hooks.enter)
            module.register_forward_hook(hooks.leave, always_call=True)  # leave even if the forward raises
        for owner in _call_site_owners(layer, piece):
            setattr(owner, _PIECES_ATTRIBUTE, {**getattr(owner, _PIECES_ATTRIBUTE, {}), piece: region})


def offloaded_saved_tensors(owner, piece):
    """The context for the call of the piece `piece` inside the module `owner`: what it saves for backward goes to
    host memory when fine-grained offloading covers it; a no-op otherwise."""
    region = getattr(owner, _PIECES_ATTRIBUTE, {}).get(piece)
    return contextlib.nullcontext() if region is None else region.context(owner)
