"""`--bf16` checkpoints across wrappers keep the fp32 main weights exact.

FSDP2 keeps fp32 weights (computing in bf16) and saves them as the model's weights, with no
`optimizer.state.<name>.fp32_param`; DDP (plain or with the distributed optimizer) and Megatron-FSDP save bf16
model weights and their fp32 main weights as `fp32_param`. Whichever wrote it, a loader keeping fp32 main weights
takes them from the checkpoint's fp32 values: a run that loads a checkpoint and saves it again saves the same fp32
weights bit for bit (and bf16 model weights rounded from them).
"""

import pytest
import torch

from tests.unit_tests.multiprocess_harness import run_on_ranks

FSDP2 = "--use-torch-fsdp2"
DDP = ""
DISTRIBUTED_OPTIMIZER = "--use-distributed-optimizer"
MEGATRON_FSDP = "--use-megatron-fsdp"


def _load_and_save_again(root, save_flags, load_flags_list, no_load_optim):
    """A bf16 run with `save_flags` trains a step and saves under `root`/saved; runs with each of
    `load_flags_list` load it and save it again under `root`/<index>."""
    from megatron.training import checkpointing, dist_checkpoint
    from tests.unit_tests.dist_checkpointing.pretrain_helpers import TrainingState

    state = TrainingState(f"--bf16 --ckpt-format torch_dist --save {root}/saved {save_flags}")
    state.train_steps(2)  # the first step has learning rate 0 (warmup)
    checkpointing.save_checkpoint(1, state.model, state.optimizer, state.scheduler, state.args)
    state.close()
    for index, load_flags in enumerate(load_flags_list):
        state = TrainingState(f"--bf16 --ckpt-format torch_dist --load {root}/saved --save {root}/{index} "
                              f"{'--no-load-optim' if no_load_optim else ''} {load_flags}")
        dist_checkpoint.load_dist_checkpoint(state.model, state.optimizer, state.scheduler, state.args, 1)
        checkpointing.save_checkpoint(1, state.model, state.optimizer, state.scheduler, state.args)
        state.close()


def _weights(directory):
    """{logical name: (fp32 weights, model weights)}: the fp32 weights are `fp32_param` where the checkpoint
    has it, else the model weights (fp32 ones: FSDP2's)."""
    from megatron.core.dist_checkpointing.offline import read_checkpoint

    saved = read_checkpoint(directory)
    weights = {}
    for key, value in saved.items():
        if key.startswith("model.") and torch.is_tensor(value):
            name = key[len("model."):]
            weights[name] = (saved.get(f"optimizer.state.{name}.fp32_param", value), value)
    return weights


def _check_same_fp32_weights(root, loaders):
    saved = _weights(f"{root}/saved/iter_0000001")
    assert all(fp32.dtype == torch.float32 for fp32, _ in saved.values())
    assert any(not torch.equal(fp32, fp32.bfloat16().float()) for fp32, _ in saved.values())  # not bf16 values
    differing = []  # (loader's flags, weight)
    for index, loader in enumerate(loaders):
        resaved = _weights(f"{root}/{index}/iter_0000001")
        assert sorted(resaved) == sorted(saved), loader
        for name, (fp32, model) in resaved.items():
            assert torch.equal(model, fp32.to(model.dtype)), (loader, name)
            if not torch.equal(fp32, saved[name][0]):
                differing.append((loader, name))
    assert differing == []


@pytest.mark.parametrize("no_load_optim", [False, True])
def test_fsdp2_fp32_weights_become_the_main_weights_of_other_wrappers(tmp_path, no_load_optim):
    loaders = [DDP, DISTRIBUTED_OPTIMIZER, MEGATRON_FSDP]
    run_on_ranks(1, _load_and_save_again, str(tmp_path), FSDP2, loaders, no_load_optim)
    _check_same_fp32_weights(str(tmp_path), loaders)


def test_fp32_main_weights_of_other_wrappers_become_fsdp2_weights(tmp_path):
    loaders = [FSDP2, MEGATRON_FSDP]
    run_on_ranks(1, _load_and_save_again, str(tmp_path), DISTRIBUTED_OPTIMIZER, loaders, False)
    _check_same_fp32_weights(str(tmp_path), loaders)
