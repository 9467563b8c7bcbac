"""`get_tensor_shapes`: the shapes of the activations one microbatch sends between pipeline stages, under
upstream's name and signature (the schedules use `p2p_communication.activation_shape`, which reads the groups
from parallel_state; this form takes them as arguments, as tools that size their own messages call it)."""

import torch.distributed as dist

from megatron.core.pipeline_parallel.model_access import schedule_setting


def _group_size(group):
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def get_tensor_shapes(*, seq_length, micro_batch_size, decoder_seq_length=None, config, tp_group=None,
                      cp_group=None):
    """[(local sequence length, micro batch size, hidden size)]: the sequence is split over the context-parallel
    group, and over the tensor-parallel group too with sequence parallelism. `decoder_seq_length` is for
    encoder-decoder models, which are not built here; it must be None or equal to `seq_length`."""
    if decoder_seq_length is not None and decoder_seq_length != seq_length:
        raise ValueError(f"decoder_seq_length {decoder_seq_length} != seq_length {seq_length}: encoder-decoder "
                         "models are not supported")
    hidden_size = schedule_setting(config, "hidden_size")
    if hidden_size is None:
        raise ValueError("get_tensor_shapes needs a config with hidden_size")
    divisor = _group_size(cp_group)
    if schedule_setting(config, "sequence_parallel"):
        divisor *= _group_size(tp_group)
    if seq_length % divisor != 0:
        raise ValueError(f"seq_length {seq_length} must be divisible by {divisor} (the context-parallel size, times "
                         "the tensor-parallel size with --sequence-parallel)")
    return [(seq_length // divisor, micro_batch_size, hidden_size)]
