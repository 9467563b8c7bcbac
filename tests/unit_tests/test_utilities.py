"""`Utils`: the helper Megatron-Core's unit tests use to set up parallel state on the world they run in.

A test written for Megatron-Core runs here unchanged:

    from tests.unit_tests.test_utilities import Utils

    def test_something():
        Utils.initialize_model_parallel(tensor_model_parallel_size=2)
        ...
        Utils.destroy_model_parallel()

The world is whatever the test runs in: all launched ranks under `torchrun --nproc-per-node N -m pytest`, the
task's ranks inside a `run_on_ranks` body (rank pools or torchrun), and a one-rank world in this process under
a plain `python -m pytest`. The backend is NCCL on GPU machines and gloo otherwise (rank pools are gloo).
`Utils.world_size` and `Utils.rank` are read when accessed, so they always describe the current world.
"""

import os

import torch.distributed as dist

from megatron.core import parallel_state
from tests.unit_tests.harness import launched_world


class _WorldProperties(type):
    @property
    def world_size(cls):
        """Ranks in the world this test runs in (1 in a plain pytest session)."""
        return int(os.environ.get("WORLD_SIZE", "1"))

    @property
    def rank(cls):
        """This process's rank in that world."""
        return int(os.environ.get("RANK", "0"))


class Utils(metaclass=_WorldProperties):
    @staticmethod
    def initialize_distributed():
        """Make sure the default process group of this test's world exists (idempotent)."""
        launched_world.ensure_test_world()

    @staticmethod
    def initialize_model_parallel(
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None,
        **kwargs,
    ):
        """Replace any model-parallel state with a fresh one of these sizes (kwargs go to parallel_state)."""
        parallel_state.destroy_model_parallel()
        Utils.initialize_distributed()
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size, pipeline_model_parallel_size, virtual_pipeline_model_parallel_size, **kwargs
        )

    @staticmethod
    def destroy_model_parallel():
        """Wait for every rank of the world, then drop the model-parallel groups."""
        if dist.is_initialized():
            dist.barrier()
        parallel_state.destroy_model_parallel()
