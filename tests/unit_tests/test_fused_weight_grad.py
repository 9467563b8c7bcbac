"""The zeros a gradient-accumulation-fused linear hands autograd (`megatron/core/fused_weight_grad.py`): DDP adds
`param.grad` into `main_grad` only when another use of the weight contributed to it."""

import collections

import pytest
import torch

from megatron.core.fused_weight_grad import is_untouched_placeholder, weight_grad_after_main_grad
from tests.unit_tests.multiprocess_harness import run_on_ranks


def test_placeholder_is_recognised_only_while_autograd_left_it_alone():
    weight = torch.nn.Parameter(torch.ones(3, 2))
    assert weight_grad_after_main_grad(weight) is None  # no data-parallel flag: no gradient at all
    weight.grad_added_to_main_grad = False
    for other_use in (None, "in_place", "replaced"):
        zeros = weight_grad_after_main_grad(weight)
        assert weight.grad_added_to_main_grad and torch.count_nonzero(zeros) == 0 and zeros.shape == (3, 2)
        weight.grad = zeros
        if other_use == "in_place":
            weight.grad.add_(torch.ones(3, 2))
        elif other_use == "replaced":
            weight.grad = zeros + torch.ones(3, 2)
        assert is_untouched_placeholder(weight) == (other_use is None), other_use
        assert not is_untouched_placeholder(weight)  # forgotten once checked
    weight.grad = torch.zeros(3, 2)  # zeros, but not the placeholder
    assert not is_untouched_placeholder(weight)


def _main_grad_additions_in_a_tied_gpt():
    from tests.unit_tests.models.gpt.gpt_test_utils import fixed_batch, loss_and_grads, seeded_model, tiny_config

    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    parallel_state.initialize_model_parallel()
    _, reference_grads = loss_and_grads(seeded_model(tiny_config()), fixed_batch())
    config = tiny_config(gradient_accumulation_fusion=True)
    model = seeded_model(config)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
    ddp.zero_grad_buffer()
    names = {param.main_grad.data_ptr(): name for name, param in model.named_parameters()}
    additions = collections.Counter()
    add_ = torch.Tensor.add_

    def counting_add_(self, *args, **kwargs):
        if self.data_ptr() in names:
            additions[names[self.data_ptr()]] += 1
        return add_(self, *args, **kwargs)

    tokens, labels, position_ids = fixed_batch()
    torch.Tensor.add_ = counting_add_
    try:
        ddp(tokens, position_ids, labels=labels).sum().backward()
    finally:
        torch.Tensor.add_ = add_
    ddp.finish_grad_sync()
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.main_grad, reference_grads[name], rtol=1e-5, atol=1e-6, msg=name)
    fused = {name for name, param in model.named_parameters()
             if name.endswith("weight") and param.dim() == 2 and "embedding" not in name}
    return dict(additions), fused


@pytest.mark.parametrize("world_size", [1])
def test_fused_weights_get_one_addition_and_a_tied_weight_two(world_size):
    """Each fused linear weight's `main_grad` is added to once per backward (by its kernel), not a second time
    with the placeholder zeros; the word embedding, also the output layer's weight, gets the output layer's
    kernel's addition and the embedding lookup's; every other parameter one; the gradients equal autograd's."""
    [(additions, fused)] = run_on_ranks(world_size, _main_grad_additions_in_a_tied_gpt)
    assert fused and all(additions[name] == 1 for name in fused), additions
    assert additions["embedding.word_embeddings.weight"] == 2
    assert set(additions.values()) == {1, 2} and sum(value == 2 for value in additions.values()) == 1, additions
