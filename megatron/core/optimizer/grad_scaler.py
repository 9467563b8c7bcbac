"""Loss scalers for fp16 training: a constant one and a dynamic one with growth, backoff and hysteresis.

On resume, as upstream, a static scale (`--loss-scale`) is the flag's, whatever the checkpoint holds; a dynamic one
continues from the checkpoint's scale and trackers when the checkpoint's run scaled dynamically too, and starts
from `--initial-loss-scale` when it used a static scale (whose saved state has no trackers).
"""

import torch


class ConstantGradScaler:
    """A fixed loss scale; overflowing steps are still skipped, the scale never changes."""

    def __init__(self, scale, device=None):
        self._scale = torch.tensor(float(scale), dtype=torch.float32, device=device)

    @property
    def scale(self):
        return self._scale

    @property
    def inv_scale(self):
        return 1.0 / self._scale

    def update(self, found_inf):
        del found_inf

    def state_dict(self):
        return {"scale": self._scale.item()}

    def load_state_dict(self, state_dict):
        """Nothing to restore: the scale is `--loss-scale` of this run, also when the checkpoint's differs."""
        del state_dict


class DynamicGradScaler:
    """Halves the scale after `hysteresis` overflowing steps, doubles it after `growth_interval` clean ones."""

    def __init__(
        self,
        initial_scale,
        min_scale=1.0,
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=1000,
        hysteresis=2,
        device=None,
    ):
        if not (0 < min_scale <= initial_scale and growth_factor > 1 and 0 < backoff_factor < 1):
            raise ValueError(
                f"DynamicGradScaler: need 0 < min_scale ({min_scale}) <= initial_scale ({initial_scale}) "
                f"(--min-loss-scale, --initial-loss-scale), growth_factor > 1 and 0 < backoff_factor < 1"
            )
        for name, flag, value in (("growth_interval", "--loss-scale-window", growth_interval),
                                  ("hysteresis", "--hysteresis", hysteresis)):
            if value < 1:
                raise ValueError(f"DynamicGradScaler: {name} ({flag}) must be at least 1, got {value}")
        self._scale = torch.tensor(float(initial_scale), dtype=torch.float32, device=device)
        self.min_scale = float(min_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self._clean_steps = 0
        self._overflows_left = self.hysteresis

    @property
    def scale(self):
        return self._scale

    @property
    def inv_scale(self):
        return 1.0 / self._scale

    def update(self, found_inf):
        if found_inf:
            self._clean_steps = 0
            self._overflows_left -= 1
            if self._overflows_left <= 0:
                self._scale.fill_(max(self._scale.item() * self.backoff_factor, self.min_scale))
        else:
            self._clean_steps += 1
            if self._clean_steps == self.growth_interval:
                self._clean_steps = 0
                self._overflows_left = self.hysteresis
                self._scale.mul_(self.growth_factor)

    def state_dict(self):
        return {
            "scale": self._scale.item(),
            "growth_tracker": self._clean_steps,
            "hysteresis_tracker": self._overflows_left,
        }

    def load_state_dict(self, state_dict):
        if "growth_tracker" not in state_dict or "hysteresis_tracker" not in state_dict:
            return  # saved by a static --loss-scale run: start from this run's --initial-loss-scale
        self._scale.fill_(state_dict["scale"])
        self._clean_steps = int(state_dict["growth_tracker"])
        self._overflows_left = int(state_dict["hysteresis_tracker"])
