"""torch FSDP2's method names on a Megatron-FSDP model, for code written against `fully_shard`: the ones with a
Megatron-FSDP meaning do it, the others are refused with a message naming the Megatron-FSDP way."""

from .distributed_data_parallel_config import ShardingStrategy


class Fsdp2MethodNames:
    """Mixed into `MegatronFSDP`; uses its `schedule`, `strategy` and `groups`."""

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True):
        """FSDP2's switch for gradient accumulation: `False` for all but the last microbatch of a step acts as
        `with model.no_sync():` held until switched back (strategies 0/1 skip their reductions, 2/3 still
        reduce-scatter into their sharded gradients); `.grad` appears once a backward with sync on completed."""
        if not recurse:
            raise ValueError("set_requires_gradient_sync(recurse=False): Megatron-FSDP switches gradient sync for "
                             "the whole model only; call it with recurse=True, or use `with model.no_sync():`")
        self.schedule.sync_enabled = bool(requires_gradient_sync)

    def set_reshard_after_forward(self, reshard_after_forward: bool, *, recurse: bool = True):
        self._check_reshard_choice("set_reshard_after_forward", reshard_after_forward)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True):
        self._check_reshard_choice("set_reshard_after_backward", reshard_after_backward)

    def _check_reshard_choice(self, method: str, reshard: bool):
        """Whether compute weights are released after use is the sharding strategy, fixed at wrap time: the call
        is accepted when it asks for what the strategy does, and refused otherwise."""
        releases = self.strategy == ShardingStrategy.optim_grads_params
        if bool(reshard) != releases:
            raise ValueError(
                f"{method}({reshard}): Megatron-FSDP decides this by zero_dp_strategy when wrapping (this model: "
                f"'{self.strategy.name}'): 'optim_grads_params' (3) releases gathered weights after forward and "
                "backward, 'optim_grads' (2) keeps them gathered and still shards gradients and optimizer state; "
                "wrap the model with the strategy you want")

    def reshard(self):
        """FSDP2's `reshard()`: under strategy 3 the forward and backward hooks release every unit after use, so
        between steps there is nothing left gathered and this is a no-op; a call mid-step is refused."""
        if self.strategy != ShardingStrategy.optim_grads_params:
            raise ValueError(f"reshard(): zero_dp_strategy '{self.strategy.name}' keeps the compute weights "
                             "gathered by design; wrap with zero_dp_strategy='optim_grads_params' (3) to release them")
        if any(group.gathered for group in self.groups):
            raise RuntimeError("reshard(): some parameters are gathered for the forward/backward in progress (or "
                               "inside `gathered_parameters()`); Megatron-FSDP releases them itself when they are "
                               "done")

    def unshard(self, async_op: bool = False):
        raise RuntimeError("unshard(): Megatron-FSDP gathers parameters in its own forward/backward hooks. To use "
                           "the full parameters between steps: `with model.gathered_parameters() as module: ...` "
                           "(released on exit); to keep them gathered through the step: zero_dp_strategy="
                           "'optim_grads' (2)")
