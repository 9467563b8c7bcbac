"""The random-number state a checkpoint saves per rank: Python, NumPy, torch CPU, the tensor-parallel RNG
tracker and the accelerator's generator."""

import random

import numpy as np
import torch


def rng_state():
    from megatron.core.device_utils import get_current_device, get_rng_state
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "rng_tracker_states": get_cuda_rng_tracker().get_states(),
    }
    device = get_current_device()
    if device.type != "cpu":
        state["device_rng_state"] = get_rng_state(device)
    return state


def set_rng_state(state):
    from megatron.core.device_utils import get_current_device
    from megatron.core.device_utils import set_rng_state as set_device_rng_state
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    get_cuda_rng_tracker().set_states(state["rng_tracker_states"])
    device = get_current_device()
    if "device_rng_state" in state and device.type != "cpu":
        set_device_rng_state(state["device_rng_state"], device)
