"""A Hugging Face transformers causal LM trained with a plain torch loop under Megatron-FSDP matches the same model
trained on one rank: decoder layers as units, the tied input / output embedding, the HF output object, torch's
clip_grad_norm_ and LR scheduler, greedy `model.generate`, a full state dict saved with `save_pretrained` and
read back with `from_pretrained`, activation checkpointing with LoRA-style frozen base weights.

The ranks split each global batch of BATCH sequences; the loss is HF's token mean, equal on every rank's share,
so the mean of the rank losses is the one-rank loss. SGD keeps the weight comparison tight: AdamW divides each
gradient element by its own magnitude, so an element whose exact gradient is zero (a key projection's bias, by
the softmax's shift invariance) takes +-lr steps from rounding noise that depends on the summation order."""

import pytest
import torch

from tests.unit_tests.multiprocess_harness import run_on_ranks

pytest.importorskip("transformers", reason="the Hugging Face model tests need transformers (the `dev` extra)")

WORLD_SIZE = 3  # hidden 64 and vocab 256 split unevenly over three ranks
BATCH, SEQ, NUM_STEPS = 6, 8, 3
PROMPT_LEN, NEW_TOKENS = 4, 6
LR, MOMENTUM, MAX_NORM = 0.5, 0.9, 1.0


def _llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=True, attn_implementation="eager")
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def _batches():
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (BATCH, SEQ), generator=generator) for _ in range(NUM_STEPS)]


def _rank_rows(tokens):
    import torch.distributed as dist

    per_rank = tokens.shape[0] // dist.get_world_size()
    return tokens[dist.get_rank() * per_rank:(dist.get_rank() + 1) * per_rank]


def _train(model, optimizer, trainable, shard):
    """NUM_STEPS steps of SGD with clipping and a StepLR; the losses, clip norms and the first step's tied-weight
    gradient (full tensor) come back."""
    import torch.distributed as dist

    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    losses, norms, tied_grad = [], [], None
    for step, tokens in enumerate(_batches()):
        tokens = _rank_rows(tokens) if shard else tokens
        optimizer.zero_grad(set_to_none=step % 2 == 0)
        output = model(input_ids=tokens, labels=tokens)
        output.loss.backward()
        if step == 0:
            grad = trainable().lm_head.weight.grad
            tied_grad = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).clone()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        optimizer.step()
        scheduler.step()
        loss = output.loss.detach().clone()
        if shard:
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
        losses.append(loss.item())
    return losses, norms, tied_grad


def _prompt():
    return _batches()[0][:1, :PROMPT_LEN]


def _train_generate_save(strategy, save_dir):
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    import megatron_fsdp

    module = _llama()
    optimizer = torch.optim.SGD(module.parameters(), lr=LR, momentum=MOMENTUM)
    model, optimizer = megatron_fsdp.fully_shard(module, optimizer, fsdp_unit_modules=[LlamaDecoderLayer],
                                                 zero_dp_strategy=strategy)
    losses, norms, tied_grad = _train(model, optimizer, lambda: model.module, shard=True)
    model.eval()
    tokens = model.generate(_prompt(), max_new_tokens=NEW_TOKENS, do_sample=False)
    model.train()
    try:
        model.config
        attribute_error = ""
    except AttributeError as error:
        attribute_error = str(error)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    if dist.get_rank() == 0:
        model.module.save_pretrained(f"{save_dir}_{strategy}", state_dict=dict(full))  # HF empties the dict
    dist.barrier()
    return {"losses": losses, "norms": norms, "tied_grad": tied_grad, "tokens": tokens,
            "tied": module.lm_head.weight is module.model.embed_tokens.weight, "full": full,
            "attribute_error": attribute_error, "training": model.training and module.training}


def _one_rank_reference():
    module = _llama()
    optimizer = torch.optim.SGD(module.parameters(), lr=LR, momentum=MOMENTUM)
    losses, norms, tied_grad = _train(module, optimizer, lambda: module, shard=False)
    tokens = module.generate(_prompt(), max_new_tokens=NEW_TOKENS, do_sample=False)
    return module, losses, norms, tied_grad, tokens


@pytest.mark.parametrize("world_size", [WORLD_SIZE])
def test_llama_trains_generates_and_saves_like_one_rank(world_size, tmp_path):
    from transformers import LlamaForCausalLM

    reference, losses, norms, tied_grad, tokens = _one_rank_reference()
    reference_state = reference.state_dict()
    save_dir = str(tmp_path / "hf")
    for strategy in (0, 3):
        for rank_result in run_on_ranks(world_size, _train_generate_save, strategy, save_dir):
            assert rank_result["tied"], strategy  # lm_head still shares the embedding's parameter
            assert rank_result["losses"] == pytest.approx(losses, abs=1e-5), strategy
            assert rank_result["norms"] == pytest.approx(norms, rel=1e-5), strategy
            # both uses of the tied weight (input embedding and output layer) counted once each
            torch.testing.assert_close(rank_result["tied_grad"], tied_grad, rtol=0, atol=1e-6)
            assert torch.equal(rank_result["tokens"], tokens), strategy
            assert rank_result["training"], strategy
            assert "use `model.module.config`" in rank_result["attribute_error"], strategy
            assert set(rank_result["full"]) == set(reference_state), strategy
            for name, value in reference_state.items():
                torch.testing.assert_close(rank_result["full"][name], value, rtol=0, atol=1e-5, msg=name)
        loaded = LlamaForCausalLM.from_pretrained(f"{save_dir}_{strategy}")
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
        for name, value in loaded.state_dict().items():
            torch.testing.assert_close(value, reference_state[name], rtol=0, atol=1e-5, msg=name)


class _LoRALinear(torch.nn.Module):
    """A frozen linear plus a trainable low-rank update (the base stays in the unit's frozen group)."""

    def __init__(self, base, rank=4):
        super().__init__()
        self.base = base
        self.lora_a = torch.nn.Linear(base.in_features, rank, bias=False)
        self.lora_b = torch.nn.Linear(rank, base.out_features, bias=False)

    def forward(self, x):
        return self.base(x) + self.lora_b(self.lora_a(x))


def _lora_llama():
    module = _llama()
    module.requires_grad_(False)
    torch.manual_seed(2)
    for layer in module.model.layers:
        layer.self_attn.q_proj = _LoRALinear(layer.self_attn.q_proj)
        layer.self_attn.v_proj = _LoRALinear(layer.self_attn.v_proj)
    # transformers 5 renamed it; gradient_checkpointing_enable() is the deprecated alias
    getattr(module, "activation_checkpointing_enable", module.gradient_checkpointing_enable)()
    return module


def _train_lora(module, optimizer, model, shard):
    import torch.distributed as dist

    losses = []
    for tokens in _batches():
        tokens = _rank_rows(tokens) if shard else tokens

        def closure():
            optimizer.zero_grad()
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            return loss

        loss = optimizer.step(closure).detach().clone()
        if shard:
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
        losses.append(loss.item())
    return losses


def _lora_on_ranks(strategy):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    import megatron_fsdp

    module = _lora_llama()
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-2)
    model, optimizer = megatron_fsdp.fully_shard(module, optimizer, fsdp_unit_modules=[LlamaDecoderLayer],
                                                 zero_dp_strategy=strategy)
    losses = _train_lora(module, optimizer, model, shard=True)
    return losses, get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


@pytest.mark.parametrize("world_size", [WORLD_SIZE])
def test_lora_style_frozen_base_with_activation_checkpointing(world_size):
    reference = _lora_llama()
    optimizer = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-2)
    losses = _train_lora(reference, optimizer, reference, shard=False)
    reference_state = reference.state_dict()
    for strategy in (2, 3):
        for rank_losses, full in run_on_ranks(world_size, _lora_on_ranks, strategy):
            assert rank_losses == pytest.approx(losses, abs=1e-5), strategy
            for name, value in reference_state.items():
                # frozen weights exactly as built; the adapters within AdamW's noise floor (module docstring)
                tolerance = 1e-5 if "lora_" in name else 0.0
                torch.testing.assert_close(full[name], value, rtol=0, atol=tolerance, msg=name)
