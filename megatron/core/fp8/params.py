"""FP8 compute weights for `--fp8-param-gather` with the distributed optimizer.

The weights of the linear layers that run inside FP8 regions live in a buffer of their own. Besides the usual
high-precision storage that autograd and checkpoints see, such a buffer holds `Fp8ParamStorage`: the FP8 bytes
of every weight (one per element) and one scale per weight. After each optimizer step every rank quantizes its
fp32 main shards into its slice of those bytes with a scale agreed across the data-parallel shard group and the
tensor-parallel group (the MAX of the shards' amaxes), then the bytes are all-gathered (as uint8, which every
backend moves). Each weight's high-precision value is then set to the dequantized FP8 weight, the value the
model really computes with, and under `--transformer-impl local` the weight also carries `weight.fp8_weight`
(a `ScaledFloat8` viewing the gathered bytes), which the torch-native FP8 linear uses as it is.

Under `--transformer-impl transformer_engine` the weights travel the same way, but TE's layers know nothing of
`fp8_weight`: they compute with the dequantized high-precision weight, which TE's autocast quantizes again.
A value on the FP8 grid re-quantizes to the same bytes when TE's weight scale equals the scale it was gathered
with (current scaling of a weight that is not split over tensor-parallel ranks: both are 448 / amax of the
whole weight); otherwise (delayed scaling, or TE scaling a TP shard by the shard's own amax) it is rounded a
second time (and under delayed scaling elements above the previous step's amax saturate): one more FP8 error
of the weight, of the size of FP8's own (`tests/unit_tests/test_fp8_param_gather_decode.py`).
"""

import torch

from megatron.core.fp8.context import is_first_last_bf16_layer
from megatron.core.fp8.formats import get_fp8_format
from megatron.core.fp8.recipe import scale_margin_of
from megatron.core.fp8.scaling import all_reduce_max, tensor_parallel_group_if_sharded
from megatron.core.fp8.tensor import ScaledFloat8, quantize, scale_from_amax


def fp8_weight_params(module, config):
    """The weights that run in FP8 regions: the linear weights of transformer layers outside the
    `--first-last-layers-bf16` ranges (not the embedding, the output layer, norms or biases), of the local
    layers or of Transformer Engine's, per `config.transformer_impl`."""
    from megatron.core.extensions.transformer_engine import fp8_linear_classes
    from megatron.core.transformer.transformer_layer import TransformerLayer

    linear_classes = fp8_linear_classes(config)
    weights = []
    for layer in module.modules():
        if not isinstance(layer, TransformerLayer) or is_first_last_bf16_layer(config, layer.layer_number - 1):
            continue
        for submodule in layer.modules():
            if isinstance(submodule, linear_classes) and getattr(submodule, "weight", None) is not None:
                weights.append(submodule.weight)
    return weights


def consumes_fp8_weights(config) -> bool:
    """Whether the FP8 layers use a weight's gathered `fp8_weight` directly (the torch-native FP8 linear) rather
    than its dequantized high-precision value (Transformer Engine's layers, which quantize it again)."""
    return getattr(config, "transformer_impl", "local") == "local"


class Fp8ParamStorage:
    """FP8 bytes and per-parameter scales of one flat parameter buffer (see the module docstring).

    Args:
        numel: elements of the buffer.
        device: where the bytes live.
        dtype: the float8 dtype weights are stored in (the recipe's forward dtype).
        margin: `--fp8-margin` under delayed scaling (current scaling takes none).
        attach_fp8_weight: give each weight `fp8_weight` as well as its dequantized value (False: the
            dequantized value only, for layers that quantize their weights themselves, such as TE's).
    """

    def __init__(self, numel, device, dtype, margin=0, attach_fp8_weight=True):
        self.data = torch.zeros(numel, dtype=torch.uint8, device=device)
        self.dtype = dtype
        self.margin = margin
        self.attach_fp8_weight = attach_fp8_weight
        self.scales = {}

    @classmethod
    def from_config(cls, numel, device, config):
        return cls(numel, device, get_fp8_format(config.fp8).forward_dtype, scale_margin_of(config),
                   attach_fp8_weight=consumes_fp8_weights(config))

    def weight(self, param, start, end):
        """The FP8 weight of `param` (elements `[start, end)` of the buffer)."""
        data = self.data[start:end].view(self.dtype).view(param.shape)
        return ScaledFloat8(data, self.scales[param])

    @torch.no_grad()
    def install(self, params, param_index_map):
        """Set each of `params`' high-precision value to its gathered FP8 weight (and give it `fp8_weight`)."""
        for param in params:
            start, end, _ = param_index_map[param]
            fp8_weight = self.weight(param, start, end)
            if self.attach_fp8_weight:
                param.fp8_weight = fp8_weight
            param.data.copy_(fp8_weight.dequantize(param.dtype))

    @torch.no_grad()
    def quantize_main_shards(self, buffer, shards, shard_groups):
        """Write this rank's main shards into the FP8 bytes with scales agreed across `shard_groups` and the
        tensor-parallel group; every rank of those groups must call this for the same buffer."""
        index_of = {param: index for index, param in enumerate(buffer.params)}
        amaxes = torch.zeros(len(buffer.params), dtype=torch.float32, device=self.data.device)
        for shard in shards:
            if shard.main_param.numel():
                amaxes[index_of[shard.model_param]] = shard.main_param.detach().abs().max().float()
        all_reduce_max(amaxes, [*shard_groups, tensor_parallel_group_if_sharded()])
        scales = scale_from_amax(amaxes, self.dtype, self.margin)
        for param, index in index_of.items():
            self.scales[param] = scales[index].clone()
        for shard in shards:
            start = shard.buffer_start
            end = start + shard.param_end - shard.param_start
            fp8_shard = quantize(shard.main_param.detach(), self.dtype, self.scales[shard.model_param])
            self.data[start:end].copy_(fp8_shard.data.view(torch.uint8))


def quantize_main_params_into_fp8_buffers(model_chunks, shards):
    """For every FP8 parameter buffer of `model_chunks` (same order on all ranks), quantize the owned main
    shards into its FP8 bytes. Returns the shards whose buffers have no FP8 storage (copied as usual)."""
    shards_by_buffer = {}
    for shard in shards:
        shards_by_buffer.setdefault(id(shard.buffer), []).append(shard)
    plain_shards = [shard for shard in shards if getattr(shard.buffer, "fp8_storage", None) is None]
    for chunk in model_chunks:
        for buffer in chunk.buffers:
            storage = getattr(buffer, "fp8_storage", None)
            if storage is None:
                continue
            groups = [buffer.groups.shard_group]
            storage.quantize_main_shards(buffer, shards_by_buffer.get(id(buffer), []), groups)
    return plain_shards


def _modules_of(model, name):
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    if not all(isinstance(chunk, torch.nn.Module) for chunk in chunks):
        raise TypeError(f"{name}: model must be a torch.nn.Module or a list of them (the model chunks), got "
                        f"{type(model).__name__}")
    return chunks


def correct_amax_history_if_needed(model) -> None:
    """Nothing to correct here, by design: the weights `--fp8-param-gather` quantizes are scaled by their own
    current amax (`Fp8ParamStorage.quantize_main_shards`) and never write into the layers' delayed-scaling amax
    histories, so no stale weight amax reaches a history after a step or a checkpoint load. Accepts a module or
    the list of model chunks, as the training loop passes them."""
    _modules_of(model, "correct_amax_history_if_needed")


def quantize_param_shard(model_params, main_params, start_offsets, data_parallel_group,
                         fsdp_shard_model_params=None) -> None:
    """Not available: it writes main-parameter shards into Transformer Engine Float8Tensor parameters, and this
    codebase builds every weight in high precision (no FP8 parameters; `get_fp8_context(..., is_init=True)` is a
    null context). With `--fp8-param-gather` the distributed optimizer and Megatron-FSDP quantize the main shards
    into their FP8 gather buffers themselves (`quantize_main_params_into_fp8_buffers`, `fsdp_gather`). An empty
    `model_params` is accepted and does nothing, as there is nothing to quantize."""
    if len(model_params) == 0:
        return
    raise NotImplementedError(
        "quantize_param_shard quantizes into Transformer Engine Float8Tensor parameters, which this codebase does "
        "not create; use --fp8-param-gather, whose optimizer step quantizes the main shards into the FP8 gather "
        "buffers (megatron.core.fp8.params.quantize_main_params_into_fp8_buffers)")
