"""A torch_dist checkpoint written by Megatron-FSDP with an expert tensor-parallel size other than the
tensor-parallel size (TP2 / ETP1 and TP1 / ETP2, EP2) holds every expert whole and loads at TP1 / EP1."""

import torch

from megatron.core.expert_parameters import global_expert_name, is_expert_parameter
from tests.unit_tests.multiprocess_harness import run_on_ranks

MOE = ("--num-layers 1 --num-experts 4 --moe-router-topk 2 --moe-token-dispatcher-type alltoall "
       "--ckpt-format torch_dist")
MEGATRON_FSDP = ("--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params "
                 "--expert-model-parallel-size 2")
SAVED = {"tp2_etp1": "--tensor-model-parallel-size 2 --sequence-parallel --expert-tensor-parallel-size 1",
         "tp1_etp2": "--expert-tensor-parallel-size 2"}


def _experts(state):
    """{global expert name: value} of the (TP1 / EP1, so whole) experts of `state`."""
    return {global_expert_name(name, param): param.detach().clone()
            for chunk in state.model for name, param in chunk.module.named_parameters() if is_expert_parameter(param)}


def _save_under_megatron_fsdp_then_load_at_tp1(root):
    from megatron.training import checkpointing, dist_checkpoint
    from tests.unit_tests.dist_checkpointing.pretrain_helpers import TrainingState

    state = TrainingState(f"{MOE} --seed 1234")
    expected = _experts(state)  # expert initialisation depends on the seed and the global index only
    state.close()
    loaded = {}
    for layout, flags in SAVED.items():
        directory = f"{root}/{layout}"
        state = TrainingState(f"{MOE} {MEGATRON_FSDP} {flags} --seed 1234 --save {directory}")
        checkpointing.save_checkpoint(1, state.model, state.optimizer, state.scheduler, state.args)
        state.close()
        state = TrainingState(f"{MOE} --seed 7 --load {directory}")
        before = _experts(state)
        dist_checkpoint.load_dist_checkpoint(state.model, state.optimizer, state.scheduler, state.args, 1)
        loaded[layout] = (before, _experts(state))
        state.close()
    return expected, loaded


def test_megatron_fsdp_checkpoint_at_another_expert_tensor_parallel_size_holds_whole_experts(tmp_path):
    expected, loaded = run_on_ranks(4, _save_under_megatron_fsdp_then_load_at_tp1, str(tmp_path))[0]
    assert len(expected) == 16  # 4 experts, fc1 and fc2 weights and biases
    for layout, (before, after) in loaded.items():
        assert sorted(after) == sorted(expected), layout
        assert any(not torch.equal(before[name], value) for name, value in expected.items()), layout
        for name, value in expected.items():
            assert torch.equal(after[name], value), (layout, name)
