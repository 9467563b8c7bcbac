"""Delayed-scaling state after a checkpoint load into a model that has already trained: the next step computes
what the same load into a freshly built model computes, whether the load goes through the layers'
`load_state_dict` or writes the amax-history buffers in place (Megatron-FSDP's `load_state_dict`).

The loaded histories are empty (a checkpoint written before the first step), so a model that kept the host-side
"a history was recorded" of its own steps would scale by the empty history (scale 1) instead of by each tensor's
own amax, and would push the amaxes pending from before the load into the loaded history.
"""

import torch

from tests.unit_tests.fp8.fsdp_fp8_model import amax_histories, fsdp_fp8_chunk
from tests.unit_tests.multiprocess_harness import run_on_ranks


def _delayed_layer():
    from megatron.core.extensions.transformer_engine import layer_classes
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, fp8="hybrid",
                               fp8_recipe="delayed", fp8_amax_history_len=2)
    torch.manual_seed(0)
    return layer_classes(config)[0](16, 32, config=config, init_method=torch.nn.init.normal_, bias=True), config


def _microbatch(layer, config, x):
    from megatron.core import fp8_utils

    with fp8_utils.get_fp8_context(config, layer_no=0):
        out, _ = layer(x)
    out.square().sum().backward()
    return out.detach()


def _step_after_load(layer, config, x):
    from megatron.core import fp8_utils

    layer.zero_grad(set_to_none=True)
    out = _microbatch(layer, config, x)
    fp8_utils.reduce_fp8_amaxes([layer])
    return out, layer.weight.grad.clone(), layer.fp8_amax_history.clone(), layer.fp8_amax_recorded_count.clone()


def _load_in_place(module, state):
    """What Megatron-FSDP's `load_state_dict` does to a module's tensors: copies into them, with no module hook."""
    with torch.no_grad():
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            tensor.copy_(state[name])


def test_a_load_in_place_starts_the_histories_over_as_a_fresh_model_would():
    from megatron.core import fp8_utils

    trained, config = _delayed_layer()
    checkpoint = {name: value.clone() for name, value in trained.state_dict().items()}  # empty histories
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1)) * 3
    for _ in range(2):
        _microbatch(trained, config, x)
        fp8_utils.reduce_fp8_amaxes([trained])
    _microbatch(trained, config, x * 5)  # amaxes pending when the load comes
    assert trained.fp8_amax_recorded_count.tolist() == [2, 2, 2]

    _load_in_place(trained, checkpoint)
    fresh, _ = _delayed_layer()
    fresh.load_state_dict(checkpoint)
    after_load = _step_after_load(trained, config, x)
    reference = _step_after_load(fresh, config, x)
    # Scaled by each tensor's own amax (the loaded histories are empty), and the histories record this step's only.
    for got, want in zip(after_load, reference):
        assert torch.equal(got, want)
    assert after_load[3].tolist() == [1, 1, 1]
    assert after_load[2][:, 1].tolist() == [0.0, 0.0, 0.0]
    # The amaxes of this step (the scaled-up microbatch's larger input amax is not among them).
    assert after_load[2][0, 0] == x.abs().max()


def test_scaling_states_built_under_inference_mode_quantize():
    """Inference tensors have no version counter: histories created under `torch.inference_mode` still work."""
    from megatron.core import fp8_utils
    from megatron.core.fp8.scaling import LinearScaling

    x = torch.randn(4, 16)
    for recipe in ("tensorwise", "delayed"):
        with torch.inference_mode():
            scaling = LinearScaling(fp8_utils.Fp8RecipeSettings(fp8_utils.get_fp8_format("hybrid"), recipe), "none")
            first = scaling.input.quantize(x)
            fp8_utils.reduce_and_record_amaxes(scaling.states(), [])
            again = scaling.input.quantize(x)
        assert torch.equal(again.data.view(torch.uint8), first.data.view(torch.uint8))
        assert torch.equal(first.scale, torch.tensor(448.0) * torch.reciprocal(x.abs().max()))


def _fsdp_step(chunk, tokens):
    position_ids = torch.arange(tokens.shape[1]).expand_as(tokens)
    chunk.zero_grad_buffer()
    loss = chunk(tokens, position_ids, None, labels=tokens).sum()
    loss.backward()
    return loss.detach()


def _fsdp_load_on_ranks():
    import torch.distributed as dist

    from megatron.core import fp8_utils

    tokens, other_tokens = torch.randint(0, 32, (2, 2, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
    chunk = fsdp_fp8_chunk(2)
    checkpoint = {key: (value.full_tensor() if hasattr(value, "full_tensor") else value).clone()
                  for key, value in chunk.state_dict().items() if torch.is_tensor(value)}
    for _ in range(2):
        _fsdp_step(chunk, tokens)
        fp8_utils.reduce_fp8_amaxes([chunk])
    _fsdp_step(chunk, other_tokens)  # amaxes pending when the load comes
    chunk.load_state_dict(checkpoint)
    loss = _fsdp_step(chunk, tokens)
    fp8_utils.reduce_fp8_amaxes([chunk])

    fresh = fsdp_fp8_chunk(2)
    fresh.load_state_dict(checkpoint)
    fresh_loss = _fsdp_step(fresh, tokens)
    fp8_utils.reduce_fp8_amaxes([fresh])
    return loss, fresh_loss, amax_histories(chunk), amax_histories(fresh)


def test_megatron_fsdp_load_starts_the_histories_over_as_a_fresh_model_would():
    for loss, fresh_loss, histories, fresh_histories in run_on_ranks(2, _fsdp_load_on_ranks):
        assert torch.equal(loss, fresh_loss)
        assert len(histories) == 4  # the four FP8 linears of the one transformer layer
        for history, fresh_history in zip(histories, fresh_histories):
            assert torch.equal(history, fresh_history)
            assert history[:, 1].tolist() == [0.0, 0.0, 0.0]  # one record since the load: the loaded zeros moved
