"""`GPTModel.forward(decoder_input=...)` under sequence and context parallelism: as upstream, `decoder_input` is
the embedding output in this rank's layout (`[s / tp, b, h]` with --sequence-parallel, this rank's two
context-parallel chunks of the sequence with --context-parallel-size), and the loss and the gradient reaching
`decoder_input` equal a single-rank model's on the same rows. With `scatter_embedding_sequence_parallel=False`
the embedding returns the whole `[s, b, h]` for the caller to scatter (upstream's multimodal models)."""

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.context_parallel import local_rows
from tests.unit_tests.models.gpt.gpt_test_utils import MICRO_BATCH_SIZE, SEQ_LENGTH, fixed_batch, seeded_model, \
    tiny_config
from tests.unit_tests.multiprocess_harness import run_on_ranks


def _loss_and_input_grad(model, decoder_input, labels):
    decoder_input = decoder_input.detach().clone().requires_grad_()
    loss = model(None, None, None, decoder_input, labels)
    loss.sum().backward()
    return loss.detach(), decoder_input.grad


def _unscattered_embedding(errors, tokens, positions, labels, embedded_loss, world, kwargs):
    model = seeded_model(tiny_config(tp=world, sequence_parallel=True, num_layers=1),
                         scatter_embedding_sequence_parallel=False, **kwargs)
    with torch.no_grad():
        whole = model.embedding(tokens, positions)
        assert whole.shape == (SEQ_LENGTH, MICRO_BATCH_SIZE, 32), whole.shape
        scattered = tensor_parallel.scatter_to_sequence_parallel_region(whole)
        errors["unscattered embedding, caller scatters"] = (model(None, None, None, scattered, labels)
                                                            - embedded_loss).abs().max().item()
        errors["unscattered embedding, forward scatters"] = (model(tokens, positions, labels=labels)
                                                             - embedded_loss).abs().max().item()


def _decoder_input_at_tp2_sp_and_cp2(position_embedding_type):
    tokens, labels, positions = fixed_batch()
    rank, world = dist.get_rank(), dist.get_world_size()
    hidden = 32
    decoder_input = torch.randn(SEQ_LENGTH, MICRO_BATCH_SIZE, hidden, generator=torch.Generator().manual_seed(3))
    kwargs = dict(position_embedding_type=position_embedding_type)

    parallel_state.initialize_model_parallel()
    reference = seeded_model(tiny_config(num_layers=1), **kwargs)
    reference_loss, reference_grad = _loss_and_input_grad(reference, decoder_input, labels)
    with torch.no_grad():  # the embedding's own output, fed back, gives the loss of the token ids
        embedded_loss = reference(None, None, None, reference.embedding(tokens, positions), labels)
    torch.testing.assert_close(embedded_loss, reference(tokens, positions, labels=labels).detach(), atol=0, rtol=0)
    reference_state = reference.state_dict()
    parallel_state.destroy_model_parallel()
    errors = {}

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    model = seeded_model(tiny_config(tp=world, sequence_parallel=True, num_layers=1), **kwargs)
    rows = SEQ_LENGTH // world
    loss, grad = _loss_and_input_grad(model, decoder_input[rank * rows : (rank + 1) * rows], labels)
    with torch.no_grad():
        embedded = model.embedding(tokens, positions)
        assert embedded.shape == (rows, MICRO_BATCH_SIZE, hidden), embedded.shape
        embedded_loss_sp = model(None, None, None, embedded, labels)
    errors["sp loss"] = (loss - reference_loss).abs().max().item()
    errors["sp input grad"] = (grad - reference_grad[rank * rows : (rank + 1) * rows]).abs().max().item()
    errors["sp embedding round trip"] = (embedded_loss_sp - embedded_loss).abs().max().item()

    # Upstream's multimodal pattern: an unscattered embedding, combined by the caller, scattered, passed back.
    if position_embedding_type == "rope":
        _unscattered_embedding(errors, tokens, positions, labels, embedded_loss, world, kwargs)
    parallel_state.destroy_model_parallel()

    parallel_state.initialize_model_parallel(context_parallel_size=world)
    model = seeded_model(tiny_config(num_layers=1, context_parallel_size=world), **kwargs)
    model.load_state_dict(reference_state)
    local_labels = local_rows(labels, 1, world, rank)
    loss, grad = _loss_and_input_grad(model, local_rows(decoder_input, 0, world, rank), local_labels)
    errors["cp loss"] = (loss - local_rows(reference_loss, 1, world, rank)).abs().max().item()
    errors["cp input grad"] = (grad - local_rows(reference_grad, 0, world, rank)).abs().max().item()
    parallel_state.destroy_model_parallel()
    return errors, reference_grad.abs().max().item()


@pytest.mark.parametrize("position_embedding_type", ["rope", "learned_absolute"])
def test_decoder_input_in_the_embedding_layout_at_tp2_sp_and_cp2(position_embedding_type):
    for errors, largest_grad in run_on_ranks(2, _decoder_input_at_tp2_sp_and_cp2, position_embedding_type):
        assert largest_grad > 1e-3
        assert max(errors.values()) < 1e-5, errors
