"""FP8 compute weights for `--fp8-param-gather` with Megatron-FSDP (ZeRO-3, `optim_grads_params`).

Megatron-FSDP lets selected parameters travel through its all-gather encoded (`megatron_fsdp.GatherCodec`).
For the weights that run in FP8 regions (`fp8_weight_params`) the encoding is FP8: each rank quantizes its
shard of a weight, whenever the shard changed (initialisation, a load, every optimizer step), with one scale
per weight agreed across the data-parallel shard group and the tensor-parallel group (the MAX of the shards'
amaxes), and the all-gather moves those bytes as uint8 (1 byte per element instead of 4). When a gather lands,
each weight's compute value is set to its dequantized FP8 weight (what the model really computes with, and
what autograd and non-FP8 code see); under `--transformer-impl local` the weight also carries
`weight.fp8_weight`, a `ScaledFloat8` viewing the gathered bytes, which the FP8 linear uses as it is, while
Transformer Engine's layers take the dequantized value and quantize it again (see `megatron.core.fp8.params`).
The fp32 main weights stay sharded and are never rounded.
"""

from typing import List, Sequence

import torch
from megatron_fsdp import GatherCodec, GatherCodecPolicy

from megatron.core.fp8.formats import get_fp8_format
from megatron.core.fp8.params import consumes_fp8_weights, fp8_weight_params
from megatron.core.fp8.recipe import scale_margin_of
from megatron.core.fp8.scaling import all_reduce_max, tensor_parallel_group_if_sharded
from megatron.core.fp8.tensor import ScaledFloat8, amax, quantize, scale_from_amax


class Fp8GatherCodec(GatherCodec):
    """FP8 bytes plus one fp32 scale per parameter of one Megatron-FSDP group.

    Args:
        dtype: the float8 dtype weights are stored in (the recipe's forward dtype).
        margin: `--fp8-margin` under delayed scaling (current scaling takes none).
        agreement_groups: process groups besides the shard group over which scales are agreed (the
            tensor-parallel group; None entries are skipped).
        attach_fp8_weight: give each gathered weight `fp8_weight` as well as its dequantized value (False:
            decode to the high-precision value only, for layers that quantize their weights themselves).
    """

    wire_dtype = torch.uint8

    def __init__(self, dtype: torch.dtype, margin: int = 0, agreement_groups: Sequence = (),
                 attach_fp8_weight: bool = True):
        self.dtype = dtype
        self.margin = margin
        self.agreement_groups = list(agreement_groups)
        self.attach_fp8_weight = attach_fp8_weight
        self.scales = None  # fp32 [num params], identical on every rank of the agreement groups

    @torch.no_grad()
    def encode(self, shard_pieces: List[torch.Tensor], wire_pieces: List[torch.Tensor], shard_group) -> None:
        device = shard_pieces[0].device
        amaxes = torch.stack([amax(piece) for piece in shard_pieces]).to(device)
        all_reduce_max(amaxes, [shard_group, *self.agreement_groups])
        self.scales = scale_from_amax(amaxes, self.dtype, self.margin)
        for piece, wire, scale in zip(shard_pieces, wire_pieces, self.scales):
            if piece.numel():
                wire.copy_(quantize(piece, self.dtype, scale).data.view(torch.uint8))

    @torch.no_grad()
    def decode(self, wire_params, compute_params, params) -> None:
        for index, (wire, compute, param) in enumerate(zip(wire_params, compute_params, params)):
            fp8_weight = ScaledFloat8(wire.view(self.dtype), self.scales[index].clone())
            if self.attach_fp8_weight:
                param.fp8_weight = fp8_weight
            compute.copy_(fp8_weight.dequantize(compute.dtype))

    def release(self, params) -> None:
        for param in params:
            param.__dict__.pop("fp8_weight", None)


def fp8_gather_codec_policy(module, config) -> GatherCodecPolicy:
    """The Megatron-FSDP gather codec policy of `--fp8-param-gather`: `module`'s FP8-region linear weights travel
    as FP8 bytes, with scales agreed over the shard group and the tensor-parallel group (local or Transformer
    Engine layers; the latter get the dequantized weights only)."""
    if not getattr(config, "fp8", None):
        raise ValueError("--fp8-param-gather needs --fp8-format (config.fp8)")
    selected = {id(param) for param in fp8_weight_params(module, config)}
    dtype = get_fp8_format(config.fp8).forward_dtype
    margin = scale_margin_of(config)
    attach = consumes_fp8_weights(config)
    return GatherCodecPolicy(
        selects=lambda param: id(param) in selected,
        make_codec=lambda: Fp8GatherCodec(dtype, margin, [tensor_parallel_group_if_sharded()], attach),
    )
