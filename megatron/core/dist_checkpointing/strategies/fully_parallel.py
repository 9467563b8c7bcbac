"""Upstream's `FullyParallelSaveStrategyWrapper` / `FullyParallelLoadStrategyWrapper`.

Upstream wraps a strategy so that data-parallel replicas split the writing (and reading) of replicated tensors
instead of the first replica doing it all. torch.distributed.checkpoint's planner already gives each replicated
piece to one rank, balancing the bytes written per rank, and each rank reads only the parts it holds, so the
wrappers hand the work to the wrapped strategy; they keep upstream's constructor so its scripts run unchanged.
"""


class FullyParallelSaveStrategyWrapper:
    def __init__(self, strategy, parallelization_group=None, do_cache_distribution: bool = False):
        self.base_strategy = strategy
        self.parallelization_group = parallelization_group
        self.do_cache_distribution = do_cache_distribution

    @property
    def process_group(self):
        """The group the save is collective over: the wrapped strategy's (the whole world by default)."""
        return getattr(self.base_strategy, "process_group", None)

    def save(self, sharded_state_dict, checkpoint_dir):
        return self.base_strategy.save(sharded_state_dict, checkpoint_dir)


class FullyParallelLoadStrategyWrapper:
    def __init__(self, strategy, parallelization_group=None, do_cache_distribution: bool = False,
                 exchange_algo: str = "broadcast"):
        self.base_strategy = strategy
        self.parallelization_group = parallelization_group
        self.do_cache_distribution = do_cache_distribution
        self.exchange_algo = exchange_algo

    @property
    def process_group(self):
        return getattr(self.base_strategy, "process_group", None)

    def load(self, sharded_state_dict, checkpoint_dir):
        return self.base_strategy.load(sharded_state_dict, checkpoint_dir)
