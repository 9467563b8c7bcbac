"""Gather codecs: parameters whose compute weights travel through the all-gather in another form.

By default a ZeRO-3 group all-gathers its compute weights as they are. A `GatherCodecPolicy` names parameters
(`selects(param)`) whose weights travel encoded instead, e.g. as FP8 bytes with one scale per parameter. The
package then puts those parameters in groups of their own (see grouping.py) and gives each such group a codec
(`make_codec()`), which it drives in three places:

- encode: when this rank's high-precision shard changed (initialisation, a load, an optimizer step), before the
  group's next all-gather, `encode(shard_pieces, wire_pieces, shard_group)` turns the shard into wire elements.
  Every rank of the shard group calls it for the same group in the same order, so it may run collectives (to
  agree on scales, say) over `shard_group` and over any groups the codec was built with.
- gather: the wire shard (one wire element per parameter element) is all-gathered instead of the compute shard.
- decode: when the gather lands, `decode(wire_params, compute_params, params)` writes each parameter's compute
  weights from its gathered wire elements, and may attach attributes to the parameters (an FP8 view, say);
  `release(params)` is called when those gathered weights are dropped, and drops what decode attached.

Only trainable parameters of strategy 3 (`optim_grads_params`) without outer-dim sharding of the main weights
(HFSDP) can be encoded: the other strategies keep full compute weights, and the optimizer steps on the fp32 main
weights, which stay as they are. At rest (between gathers) a module shows its shard pieces in high precision.
"""

import abc
from dataclasses import dataclass
from typing import Callable, List

import torch
import torch.nn as nn


class GatherCodec(abc.ABC):
    """How one parameter group's weights are encoded for the all-gather and decoded after it (one per group)."""

    #: Element type on the wire: one wire element per parameter element (use torch.uint8 for bytes, which every
    #: backend gathers; gloo rejects float8 dtypes).
    wire_dtype: torch.dtype = torch.uint8

    @abc.abstractmethod
    def encode(self, shard_pieces: List[torch.Tensor], wire_pieces: List[torch.Tensor], shard_group) -> None:
        """Write `wire_pieces[i]` (flat, `wire_dtype`) from `shard_pieces[i]`, this rank's flat piece of
        parameter `i` in high precision (possibly empty). Collective over `shard_group` (see the module docstring)."""

    @abc.abstractmethod
    def decode(self, wire_params: List[torch.Tensor], compute_params: List[torch.Tensor],
               params: List[nn.Parameter]) -> None:
        """Write `compute_params[i]` (the compute weights of `params[i]`, in its shape) from `wire_params[i]`
        (its gathered wire elements, same shape). The wire tensors stay valid until `release`."""

    def release(self, params: List[nn.Parameter]) -> None:
        """The gathered weights of `params` are being dropped: forget what `decode` attached to them."""


@dataclass(frozen=True)
class GatherCodecPolicy:
    """Which parameters travel encoded, and the codec each of their groups gets.

    Args:
        selects: `selects(param)` is True for a parameter to encode (evaluated once, on the module's parameters
            before wrapping); frozen parameters are never encoded.
        make_codec: a new `GatherCodec` (called once per group of selected parameters).
    """

    selects: Callable[[nn.Parameter], bool]
    make_codec: Callable[[], GatherCodec]

    def encodes(self, param: nn.Parameter) -> bool:
        return param.requires_grad and bool(self.selects(param))
