"""A snapshot of every random generator a training step draws from, to rerun the step with the same random
numbers (the rerun state machine)."""

import random

import numpy as np
import torch


def capture_random_state():
    """Every generator a training step draws from: Python, NumPy, torch's CPU generator, the accelerator's and
    the tensor-parallel tracker's streams."""
    from megatron.core.device_utils import get_current_device, get_rng_state
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    device = get_current_device()
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "device": get_rng_state(device) if device.type != "cpu" else None,
        "tracker": get_cuda_rng_tracker().get_states(),
    }


def restore_random_state(state):
    """Put every generator back to a `capture_random_state()` snapshot."""
    from megatron.core.device_utils import get_current_device, set_rng_state
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["device"] is not None:
        set_rng_state(state["device"], get_current_device())
    get_cuda_rng_tracker().set_states(state["tracker"])
