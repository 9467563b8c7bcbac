"""`TorchFullyShardedDataParallel` called the way upstream Megatron-Core's users call it: the unit classes as the
fourth argument or `sub_modules_to_wrap=` (upstream's default set nests `ColumnParallelLinear` inside
`TransformerLayer`), the group as `process_group=`, extra unit classes declared through `_fsdp_modules`. The
gradients must still equal the unsharded model's full-batch ones."""

import pytest
import torch
import torch.distributed as dist

from tests.unit_tests.distributed.test_torch_fully_sharded_data_parallel import _config, _gpt, _mean_loss
from tests.unit_tests.multiprocess_harness import run_on_ranks


def _upstream_default_units():
    from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer.transformer_layer import TransformerLayer

    return {TransformerLayer, LanguageModelEmbedding, RotaryEmbedding, ColumnParallelLinear}


def _errors(wrapper_class, ddp_config, group):
    """Messages of the calls that mix the upstream and local spellings of one setting."""
    messages = []
    for kwargs in (dict(sub_modules_to_wrap=_upstream_default_units(), fsdp_unit_modules=_upstream_default_units()),
                   dict(process_group=group, device_mesh=object()),
                   dict(process_group=False)):
        model = _gpt(_config())
        try:
            wrapper_class(model.config, ddp_config, model, **kwargs)
            messages.append("no error")
        except (TypeError, ValueError) as error:
            messages.append(str(error))
    return messages


def _upstream_calls():
    from torch.distributed.fsdp import FSDPModule

    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallelConfig, TorchFullyShardedDataParallel

    parallel_state.initialize_model_parallel()
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        rank, world_size = dist.get_rank(), dist.get_world_size()
        group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        ddp_config = DistributedDataParallelConfig(use_torch_fsdp2=True)
        reference = _gpt(_config())
        model = _gpt(_config())
        # A model may add unit classes of its own (here its norms: the final one and those inside each layer).
        model._fsdp_modules = [type(model.decoder.final_layernorm)]
        wrapped = TorchFullyShardedDataParallel(model.config, ddp_config, model, _upstream_default_units(),
                                                process_group=group)
        units = {name for name, submodule in model.named_modules() if isinstance(submodule, FSDPModule)}
        assert wrapped.data_parallel_group is group
        for expected in ("", "output_layer", "embedding", "decoder.final_layernorm", "decoder.layers.0",
                         "decoder.layers.1.self_attention.linear_qkv", "decoder.layers.1.mlp.linear_fc1",
                         "decoder.layers.0.input_layernorm"):
            assert expected in units, (expected, sorted(units))

        _mean_loss(wrapped, rank).backward()
        (sum(_mean_loss(reference, index) for index in range(world_size)) / world_size).backward()
        reference_grads = dict(reference.named_parameters())
        for name, param in model.named_parameters():
            torch.testing.assert_close(param.grad.full_tensor(), reference_grads[name].grad, rtol=1e-5, atol=1e-7,
                                       msg=lambda m: f"{name}: {m}")
        return _errors(TorchFullyShardedDataParallel, ddp_config, group)
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("world_size", [2])
def test_upstream_arguments_nested_units_and_declared_units(world_size):
    for messages in run_on_ranks(world_size, _upstream_calls):
        assert "sub_modules_to_wrap and fsdp_unit_modules name the same setting" in messages[0]
        assert "give process_group or device_mesh, not both" in messages[1]
        assert "process_group must be a torch.distributed ProcessGroup, got bool" in messages[2]
