"""`OptimizerParamScheduler`: learning-rate warmup and decay, and weight-decay increase, set on the optimizer.

Learning rate at step `n` (warmup `W`, which may be fractional, e.g. from `--lr-warmup-fraction`; decay end `D`):
- `n <= W` (W > 0): linear from `init_lr` to `max_lr`;
- `constant`: `max_lr` after warmup;
- `n > D`: `min_lr`;
- otherwise, with `r = (n - W) / (D - W)`: `min_lr + c(r) * (max_lr - min_lr)` where `c = 1 - r` (linear),
  `c = (cos(pi * r) + 1) / 2` (cosine); inverse-square-root instead gives `max(min_lr, max_lr * sqrt(max(W, 1)) /
  sqrt(max(n, 1)))` up to D (`min_lr` after it, like the other styles);
- `WSD` (warmup-stable-decay): `max_lr` until `D - S` (`S` = `wsd_decay_steps`), then with `q = (n - D + S) / S`:
  `c = 2 * 0.5**q - 1` (exponential), `1 - q` (linear), `(cos(pi * q) + 1) / 2` (cosine), `1 - sqrt(q)`
  (minus_sqrt); `min_lr` after D.
Weight decay goes from `start_wd` to `end_wd` over `wd_incr_steps` (constant | linear | cosine); a group may
override `start_wd`/`end_wd` (as upstream's per-group settings: `get_wd(param_group)`).
Each param group receives `lr * group["lr_mult"]` and `wd * group["wd_mult"]` (both default 1); a group may
override `max_lr`/`min_lr` (`--decoupled-lr` / `--decoupled-min-lr`: the embedding and output-layer groups).
Those two are checked against a checkpoint like `max_lr`/`min_lr` and set on the groups on load, as the optimizer's
own loading restores the checkpoint's group hyperparameters. Groups given differing `max_lr`/`min_lr` of their own
(built by hand) are followed as they are, and left as the optimizer's loading restores them.
"""

import math

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")
WD_INCR_STYLES = ("constant", "linear", "cosine")

# Saved in state_dict; checked against the constructor's arguments on load.
_CHECKED_KEYS = ("max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style", "start_wd", "end_wd",
                 "wd_incr_steps", "wd_incr_style", "wsd_decay_steps", "lr_wsd_decay_style", "decoupled_lr",
                 "decoupled_min_lr")
# The training flags each checked value comes from (steps count samples: iterations x global batch size).
_FLAGS_OF_KEY = {
    "max_lr": "--lr", "min_lr": "--min-lr", "lr_warmup_steps": "--lr-warmup-iters / --lr-warmup-samples / "
    "--lr-warmup-fraction", "lr_decay_steps": "--lr-decay-iters / --lr-decay-samples (default: the training length)",
    "lr_decay_style": "--lr-decay-style", "start_wd": "--start-weight-decay", "end_wd": "--end-weight-decay",
    "wd_incr_steps": "the training length", "wd_incr_style": "--weight-decay-incr-style",
    "wsd_decay_steps": "--lr-wsd-decay-iters / --lr-wsd-decay-samples", "lr_wsd_decay_style": "--lr-wsd-decay-style",
    "decoupled_lr": "--decoupled-lr", "decoupled_min_lr": "--decoupled-min-lr (default: --min-lr)",
}


class OptimizerParamScheduler:
    """Sets `lr` and `weight_decay` of every param group of `optimizer` from the step count."""

    def __init__(self, optimizer, init_lr, max_lr, min_lr, lr_warmup_steps, lr_decay_steps, lr_decay_style,
                 start_wd, end_wd, wd_incr_steps, wd_incr_style, use_checkpoint_opt_param_scheduler=True,
                 override_opt_param_scheduler=False, wsd_decay_steps=None, lr_wsd_decay_style="exponential"):
        self.optimizer = optimizer
        self.init_lr = float(init_lr)
        self.max_lr = float(max_lr)
        self.min_lr = float(min_lr)
        self.lr_warmup_steps = lr_warmup_steps  # not rounded: a fraction of the decay need not be whole
        self.lr_decay_steps = int(lr_decay_steps)
        self.lr_decay_style = lr_decay_style
        self.start_wd = float(start_wd)
        self.end_wd = float(end_wd)
        self.wd_incr_steps = int(wd_incr_steps)
        self.wd_incr_style = wd_incr_style
        self.wsd_decay_steps = None if wsd_decay_steps is None else int(wsd_decay_steps)
        self.lr_wsd_decay_style = lr_wsd_decay_style
        self.use_checkpoint_opt_param_scheduler = use_checkpoint_opt_param_scheduler
        self.override_opt_param_scheduler = override_opt_param_scheduler
        self.num_steps = 0
        # Groups whose `max_lr` / `min_lr` differ from one another (built by hand, as upstream's per-group rates)
        # keep them: the scheduler follows each and leaves them to the optimizer's own loading on resume.
        group_rates = {(group["max_lr"], group.get("min_lr")) for group in optimizer.param_groups if "max_lr" in group}
        self._groups_set_own_rates = len(group_rates) > 1
        # Positions of the groups with the one learning rate of their own (--decoupled-lr), and that rate (None: no
        # such group).
        self._decoupled_groups = [] if self._groups_set_own_rates else [
            index for index, group in enumerate(optimizer.param_groups) if "max_lr" in group]
        first = optimizer.param_groups[self._decoupled_groups[0]] if self._decoupled_groups else {}
        self.decoupled_lr = first.get("max_lr")
        self.decoupled_min_lr = first.get("min_lr", self.min_lr) if first else None
        self._validate()
        self.step(0)

    def _validate(self):
        if not 0.0 <= self.min_lr <= self.max_lr:
            raise ValueError(f"OptimizerParamScheduler: need 0 <= min_lr ({self.min_lr}) <= max_lr ({self.max_lr}).")
        if self.init_lr < 0 or self.init_lr > self.max_lr:
            raise ValueError(f"OptimizerParamScheduler: need 0 <= init_lr ({self.init_lr}) <= max_lr ({self.max_lr}).")
        if self.lr_decay_style not in LR_DECAY_STYLES:
            raise ValueError(
                f"OptimizerParamScheduler: lr_decay_style={self.lr_decay_style!r}; choose from {LR_DECAY_STYLES}."
            )
        if self.lr_decay_steps <= 0:
            raise ValueError(
                f"OptimizerParamScheduler: lr_decay_steps={self.lr_decay_steps} must be > 0 (--lr-decay-iters)."
            )
        if self.lr_warmup_steps < 0 or self.lr_warmup_steps >= self.lr_decay_steps:
            raise ValueError(
                f"OptimizerParamScheduler: lr_warmup_steps={self.lr_warmup_steps} must lie in [0, lr_decay_steps="
                f"{self.lr_decay_steps}); lower --lr-warmup-iters or raise --lr-decay-iters."
            )
        if self.lr_decay_style == "WSD":
            if self.wsd_decay_steps is None or not 0 < self.wsd_decay_steps <= self.lr_decay_steps:
                raise ValueError(
                    f"OptimizerParamScheduler: lr_decay_style='WSD' needs 0 < wsd_decay_steps ({self.wsd_decay_steps}) "
                    f"<= lr_decay_steps ({self.lr_decay_steps}) (--lr-wsd-decay-iters / --lr-wsd-decay-samples)."
                )
            if self.lr_wsd_decay_style not in WSD_DECAY_STYLES:
                raise ValueError(
                    f"OptimizerParamScheduler: lr_wsd_decay_style={self.lr_wsd_decay_style!r}; choose from "
                    f"{WSD_DECAY_STYLES}."
                )
        if self.wd_incr_style not in WD_INCR_STYLES:
            raise ValueError(
                f"OptimizerParamScheduler: wd_incr_style={self.wd_incr_style!r}; choose from {WD_INCR_STYLES}."
            )
        if self.start_wd < 0 or self.end_wd < self.start_wd:
            raise ValueError(
                f"OptimizerParamScheduler: need 0 <= start_wd ({self.start_wd}) <= end_wd ({self.end_wd})."
            )
        if self.wd_incr_style == "constant" and self.start_wd != self.end_wd:
            raise ValueError("OptimizerParamScheduler: wd_incr_style='constant' needs start_wd == end_wd.")
        if self.wd_incr_style != "constant" and self.wd_incr_steps <= 0:
            raise ValueError(f"OptimizerParamScheduler: wd_incr_steps={self.wd_incr_steps} must be > 0.")

    def get_wd(self, param_group=None):
        """The weight decay now, of `param_group` when given (its own `start_wd` / `end_wd` if it has them)."""
        param_group = param_group or {}
        start_wd = param_group.get("start_wd", self.start_wd)
        end_wd = param_group.get("end_wd", self.end_wd)
        if self.wd_incr_style == "constant" or self.num_steps > self.wd_incr_steps:
            return end_wd
        ratio = self.num_steps / self.wd_incr_steps
        if self.wd_incr_style == "linear":
            coeff = ratio
        else:
            coeff = 0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0)
        return start_wd + coeff * (end_wd - start_wd)

    def get_lr(self, param_group=None):
        param_group = param_group or {}
        max_lr = param_group.get("max_lr", self.max_lr)
        min_lr = param_group.get("min_lr", self.min_lr)
        warmup, steps = self.lr_warmup_steps, self.num_steps
        if warmup > 0 and steps <= warmup:
            return self.init_lr + (max_lr - self.init_lr) * steps / warmup
        if self.lr_decay_style == "constant":
            return max_lr
        if steps > self.lr_decay_steps:
            return min_lr
        if self.lr_decay_style == "inverse-square-root":
            return max(min_lr, max_lr * math.sqrt(max(warmup, 1)) / math.sqrt(max(steps, 1)))
        if self.lr_decay_style == "WSD":
            return min_lr + self._wsd_coeff(steps) * (max_lr - min_lr)
        ratio = (steps - warmup) / (self.lr_decay_steps - warmup)
        if self.lr_decay_style == "linear":
            coeff = 1.0 - ratio
        else:
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return min_lr + coeff * (max_lr - min_lr)

    def _wsd_coeff(self, steps):
        anneal_start = self.lr_decay_steps - self.wsd_decay_steps
        if steps <= anneal_start:
            return 1.0
        ratio = (steps - anneal_start) / self.wsd_decay_steps
        if self.lr_wsd_decay_style == "exponential":
            return 2.0 * 0.5**ratio - 1.0
        if self.lr_wsd_decay_style == "linear":
            return 1.0 - ratio
        if self.lr_wsd_decay_style == "cosine":
            return 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return 1.0 - math.sqrt(ratio)

    def step(self, increment=1):
        self.num_steps += increment
        for group in self.optimizer.param_groups:
            group["lr"] = self.get_lr(group) * group.get("lr_mult", 1.0)
            group["weight_decay"] = self.get_wd(group) * group.get("wd_mult", 1.0)

    def state_dict(self):
        return {"num_steps": self.num_steps, **{key: getattr(self, key) for key in _CHECKED_KEYS}}

    def _checked(self, name, current, saved):
        """The value to use for `name`: ours with override, else the checkpoint's (must match unless trusted)."""
        if self.override_opt_param_scheduler:
            return current
        if not self.use_checkpoint_opt_param_scheduler and current != saved:
            raise ValueError(
                f"OptimizerParamScheduler: {name} (from {_FLAGS_OF_KEY.get(name, name)}) is {current} in this run "
                f"but {saved} in the checkpoint; launch with --override-opt_param-scheduler to keep this run's value "
                "or --use-checkpoint-opt_param-scheduler to take the checkpoint's (in Python: "
                "override_opt_param_scheduler=True / use_checkpoint_opt_param_scheduler=True)."
            )
        return saved

    def load_state_dict(self, state_dict):
        # A rank without decoupled groups (a pipeline stage with neither embedding nor output layer) cannot tell
        # whether --decoupled-lr was given, so it does not compare it.
        skipped = () if self._decoupled_groups else ("decoupled_lr", "decoupled_min_lr")
        for key in _CHECKED_KEYS:
            if key in state_dict and key not in skipped:
                setattr(self, key, self._checked(key, getattr(self, key), state_dict[key]))
        if ("decoupled_lr" in state_dict or self.override_opt_param_scheduler) and not self._groups_set_own_rates:
            self._set_decoupled_lr_on_groups()
        self.num_steps = 0
        self.step(increment=state_dict["num_steps"])

    def _set_decoupled_lr_on_groups(self):
        """Put the decoupled learning rates chosen on load on this run's decoupled groups, and drop any the loaded
        optimizer state gave to the other groups (its groups are matched by position)."""
        for index, group in enumerate(self.optimizer.param_groups):
            if index not in self._decoupled_groups:
                group.pop("max_lr", None)
                group.pop("min_lr", None)
            elif self.decoupled_lr is None:  # the checkpoint's run had none: these groups follow --lr
                group.update(max_lr=self.max_lr, min_lr=self.min_lr)
            else:
                group.update(max_lr=self.decoupled_lr, min_lr=self.decoupled_min_lr)
