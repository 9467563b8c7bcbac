"""The multi-token prediction fields of `TransformerConfig` (`--mtp-num-layers`, `--mtp-loss-scaling-factor`,
`--mtp-use-repeated-layer`).

With `mtp_num_layers` N, the last pipeline stage runs N extra prediction depths after the decoder (see
`megatron.core.transformer.multi_token_prediction`); depth k predicts the token k + 1 positions ahead, and the
mean of the N depth losses, times `mtp_loss_scaling_factor`, is added to the language-model loss.
"""

import math
from dataclasses import dataclass
from typing import Optional

MTP_FLAG = "--mtp-num-layers"
MTP_SCALE_FLAG = "--mtp-loss-scaling-factor"
MTP_REPEATED_FLAG = "--mtp-use-repeated-layer"


@dataclass(frozen=True, kw_only=True)
class MTPConfigMixin:
    """Multi-token prediction settings (context parallelism included: the depths' shifts cross the ranks'
    chunks, see `multi_token_prediction`); validated by `_validate_multi_token_prediction` (from `__post_init__`)."""

    mtp_num_layers: Optional[int] = None
    """Prediction depths after the decoder, each one transformer layer (`--mtp-num-layers`); None: no MTP."""
    mtp_loss_scaling_factor: float = 0.1
    """The MTP loss added to the LM loss is this factor times the mean of the depths' losses
    (`--mtp-loss-scaling-factor`)."""
    mtp_use_repeated_layer: bool = False
    """One prediction layer (`mtp.layers.0`) run at every depth instead of one per depth
    (`--mtp-use-repeated-layer`)."""

    def _validate_multi_token_prediction(self):
        depths = self.mtp_num_layers
        if depths is None:
            if self.mtp_use_repeated_layer:
                raise ValueError(f"{MTP_REPEATED_FLAG} needs {MTP_FLAG} (the depths that share the layer)")
            return
        if isinstance(depths, bool) or not isinstance(depths, int) or depths < 1:
            raise ValueError(f"{MTP_FLAG} must be an integer >= 1 (or unset for no multi-token prediction), "
                             f"got {depths!r}")
        factor = self.mtp_loss_scaling_factor
        if not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor < 0:
            raise ValueError(f"{MTP_SCALE_FLAG} must be a finite number >= 0, got {factor!r}")
