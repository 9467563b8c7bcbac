"""Activation offloading (`--cpu-offloading`): losses and gradients equal to no offload (exact, fp32), the hooks
saw the chosen layers' tensors only and gave every one back, evaluation offloads nothing, and the rules."""

import pytest
import torch

from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.multiprocess_harness import run_on_ranks
from tests.unit_tests.offloading.training_steps import assert_same_training

NUM_LAYERS, OFFLOADED_LAYERS = 3, 2


def _gpt(cpu_offloading):
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from tests.unit_tests.distributed import precision_gpt as small

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(small.SEED)
    # The README's shape (RoPE, SwiGLU, RMSNorm): the value heads of the fused QKV output and the halves of the
    # gated MLP's input are saved as views that do not fill their storage.
    config = TransformerConfig(num_layers=NUM_LAYERS, hidden_size=small.HIDDEN, num_attention_heads=small.HEADS,
                               hidden_dropout=0.0, attention_dropout=0.0, init_seed=small.SEED,
                               normalization="RMSNorm", gated_linear_unit=True,
                               activation_func=torch.nn.functional.silu,
                               cpu_offloading=cpu_offloading,
                               cpu_offloading_num_layers=OFFLOADED_LAYERS if cpu_offloading else 0)
    return GPTModel(config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                    vocab_size=small.VOCAB, max_sequence_length=small.SEQ, position_embedding_type="rope",
                    share_embeddings_and_output_weights=True)


def _losses_and_grads():
    from tests.unit_tests.distributed.precision_gpt import gpt_batch, gpt_loss
    from tests.unit_tests.offloading.training_steps import losses_and_gradients

    results = {}
    for cpu_offloading in (False, True):
        model = _gpt(cpu_offloading)
        losses, grads = losses_and_gradients(model, 2, lambda model, step: gpt_loss(model, gpt_batch(step)))
        offloader = model.decoder.activation_offloader
        counts = None if offloader is None else (dict(offloader.packed), dict(offloader.unpacked),
                                                  dict(offloader.packed_bytes))
        if offloader is not None:
            offloader.reset_counters()
            with torch.no_grad():
                gpt_loss(model, gpt_batch(5))
            counts += (dict(offloader.packed),)
        results[cpu_offloading] = (losses, grads, counts)
    return results


@pytest.mark.parametrize("world_size", [2])
def test_offloaded_activations_give_the_same_losses_and_gradients(world_size):
    for results in run_on_ranks(world_size, _losses_and_grads):
        (plain_losses, plain_grads, none), (losses, grads, counts) = results[False], results[True]
        assert none is None
        assert_same_training((plain_losses, plain_grads), (losses, grads))
        packed, unpacked, packed_bytes, packed_in_eval = counts
        # Layers 1 and 2 (of 3) offloaded; every tensor came back for the backward; none in evaluation.
        assert sorted(packed) == [1, 2] and packed == unpacked
        assert all(count > 0 for count in packed.values()) and packed[1] == packed[2]
        assert all(value > 0 for value in packed_bytes.values())
        assert packed_in_eval == {}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(cpu_offloading=True), r"0 < --cpu-offloading-num-layers < --num-layers \(2\), got 0"),
        (dict(cpu_offloading=True, cpu_offloading_num_layers=2), r"--cpu-offloading-num-layers < --num-layers"),
        (dict(cpu_offloading_num_layers=1), r"--cpu-offloading-num-layers needs --cpu-offloading"),
        (dict(cpu_offloading=True, cpu_offloading_num_layers=1, recompute_granularity="selective"),
         r"--cpu-offloading does not work with --recompute-granularity"),
    ],
)
def test_config_rules_name_the_flags(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, **kwargs)


def test_flags_reach_the_transformer_config():
    from megatron.training.model_config import core_transformer_config_from_args
    from tests.unit_tests.training.test_arguments import validated

    config = core_transformer_config_from_args(validated("--cpu-offloading --cpu-offloading-num-layers 1"))
    assert (config.cpu_offloading, config.cpu_offloading_num_layers) == (True, 1)
    with pytest.raises(ValueError, match="--cpu-offloading-num-layers needs --cpu-offloading"):
        core_transformer_config_from_args(validated("--cpu-offloading-num-layers 1"))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_hooks_keep_layouts_and_values(device):
    """Saved tensors come back with their strides (a transposed operand stays transposed) and values, and the
    gradients equal those computed without the hooks; parameters are not offloaded."""
    from megatron.core.offloading.activations import ActivationOffloader, _dense

    assert _dense(torch.empty(4, 3).t()) and not _dense(torch.empty(4, 6)[:, :3])
    generator = torch.Generator().manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(5, 3, generator=generator).to(device))
    base = torch.randn(4, 5, generator=generator).to(device)

    def loss_and_grads(offloader):
        inputs = base.clone().requires_grad_(True)
        context = offloader.hooks("layer") if offloader is not None else torch.autograd.graph.saved_tensors_hooks(
            lambda t: t, lambda t: t)
        with context:
            hidden = torch.tanh(inputs.t())  # [5, 4], a transposed layout saved by the matmul below
            loss = (hidden.t() @ weight).square().sum()
        loss.backward()
        return loss.detach(), inputs.grad, weight.grad.clone()

    reference = loss_and_grads(None)
    weight.grad = None
    offloader = ActivationOffloader()
    offloaded = loss_and_grads(offloader)
    for expected, actual in zip(reference, offloaded):
        assert torch.equal(expected, actual)
    assert offloader.packed["layer"] == offloader.unpacked["layer"] >= 2  # tanh's output and the matmul operand


def test_views_that_do_not_fill_their_span_come_back_with_their_strides():
    """The value heads of a fused QKV output and one half of an interleaved gated-MLP input are views with gaps:
    they come back with the strides they were saved with (a contiguous copy would change the backward kernels'
    layouts and their last bits), their values intact, and every element of the view filled."""
    from megatron.core.offloading.activations import ActivationOffloader

    layouts = []

    class SaveAndRecord(torch.autograd.Function):
        @staticmethod
        def forward(ctx, tensor):
            ctx.save_for_backward(tensor)
            return tensor * 2

        @staticmethod
        def backward(ctx, grad):
            (saved,) = ctx.saved_tensors
            layouts.append((saved.stride(), saved.clone()))
            return grad * 2

    fused = torch.randn(4, 18, generator=torch.Generator().manual_seed(0), requires_grad=True)
    offloader = ActivationOffloader()
    with offloader.hooks("layer"):
        value_heads = fused[:, 12:]  # strides (18, 1)
        gate = fused.view(4, 9, 2)[..., 0]  # strides (18, 2)
        loss = SaveAndRecord.apply(value_heads).sum() + SaveAndRecord.apply(gate).sum()
    loss.backward()
    assert offloader.packed["layer"] == offloader.unpacked["layer"] == 2
    (gate_stride, gate_saved), (value_stride, value_saved) = layouts  # the backward runs in reverse order
    assert (value_stride, gate_stride) == ((18, 1), (18, 2))
    assert torch.equal(value_saved, fused.detach()[:, 12:]) and torch.equal(gate_saved, fused.detach()[:, ::2])


class _RecordingCopyStream:
    """A stand-in for the side stream on the CPU: copies at once and logs them (destination, source) and the
    compute stream's waits for them, in one shared log."""

    def __init__(self, log):
        self.log = log

    def __call__(self, device, overlap=True):
        return self

    def copy(self, destination, source):
        destination.copy_(source)
        self.log.append(("copy", id(source)))
        log = self.log

        class Handle:
            def wait_on_device(self, device):
                log.append(("wait", id(source)))

        return Handle()


def test_prefetch_reloads_the_next_layer_during_the_current_layers_backward():
    """Three offloaded 'layers' in a chain: when the backward pass reaches the last one, its tensors and the middle
    layer's are queued back (the middle one's copies run while the last layer's backward computes); the first
    layer's only when the middle one starts. The gradients equal those computed without offload."""
    from megatron.core.offloading.activations import ActivationOffloader

    generator = torch.Generator().manual_seed(0)
    weights = [torch.nn.Parameter(torch.randn(8, 8, generator=generator)) for _ in range(3)]
    inputs = torch.randn(4, 8, generator=generator)

    def loss(offloader):
        hidden = inputs
        for label, weight in enumerate(weights, start=1):
            context = offloader.hooks(label) if offloader else torch.autograd.graph.saved_tensors_hooks(
                lambda t: t, lambda t: t)
            with context:
                hidden = torch.tanh(hidden @ weight)
        return hidden.square().sum()

    loss(None).backward()
    reference = [weight.grad.clone() for weight in weights]
    for weight in weights:
        weight.grad = None
    log = []
    offloader = ActivationOffloader(copy_stream=_RecordingCopyStream(log))
    result = loss(offloader)
    label_of = {id(packed.host): label for label, tensors in offloader._offloaded.items() for packed in tensors}
    log.clear()  # the forward pass's copies to the host
    result.backward()
    for expected, weight in zip(reference, weights):
        assert torch.equal(expected, weight.grad)
    events = [(kind, label_of[source]) for kind, source in log]
    assert {label for _, label in events} == {1, 2, 3}
    assert offloader.packed == offloader.unpacked and sum(offloader.packed.values()) == len(label_of)

    def first(kind, label):
        return events.index((kind, label))

    def last(kind, label):
        return len(events) - 1 - events[::-1].index((kind, label))

    # Layer 3's backward starts by queueing its own tensors and layer 2's, before it waits for anything.
    assert last("copy", 2) < first("wait", 3)
    # Layer 1 is queued when layer 2's backward starts (one layer ahead, not more) and before it is needed.
    assert first("copy", 1) > last("wait", 3) and last("copy", 1) < first("wait", 2)
    # Every tensor travelled back exactly once.
    assert sum(kind == "copy" for kind, _ in events) == sum(kind == "wait" for kind, _ in events) == len(label_of)
