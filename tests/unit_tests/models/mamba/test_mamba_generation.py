"""A hybrid model generates through the static engine's context (each Mamba layer continuing every batch row from
its kept convolution inputs and scan state) the greedy tokens and log-probabilities of full forward passes over
the whole sequence so far, for prompts of different lengths in one batch."""

import pytest
import torch

from megatron.core import tensor_parallel
from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.inference.sampling_params import SamplingParams
from megatron.core.inference.static_generation import generate_static_batch
from megatron.core.models.mamba import MambaModel
from megatron.core.transformer.transformer_config import TransformerConfig

VOCAB, EOD, NEW_TOKENS = 64, 63, 9


def _model(pattern):
    tensor_parallel.model_parallel_cuda_manual_seed(1)
    config = TransformerConfig(num_layers=len(pattern), hidden_size=16, num_attention_heads=4, init_seed=3,
                               hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.3, mamba_head_dim=8,
                               mamba_num_groups=2, mamba_state_dim=4, mamba_chunk_size=4)
    return MambaModel(config, vocab_size=VOCAB, max_sequence_length=32, hybrid_override_pattern=pattern).eval()


def _full_forward_greedy(model, prompt):
    """Greedy continuation by full forwards, and each generated token's log-probability."""
    tokens, log_probs = list(prompt), []
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits = model(torch.tensor([tokens]), None, None)[0, -1].float()
            next_token = int(logits.argmax())
            log_probs.append(float(torch.log_softmax(logits, -1)[next_token]))
            tokens.append(next_token)
            if next_token == EOD:  # the engine keeps it as the last token
                break
    return tokens[len(prompt):], log_probs


@pytest.mark.parametrize("pattern", ["MMM", "M*-M"])
def test_generation_continues_each_row_from_its_kept_state(pattern):
    model = _model(pattern)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, EOD, (length,), generator=generator).tolist() for length in (3, 7, 5)]
    params = SamplingParams(top_k=1, num_tokens_to_generate=NEW_TOKENS, return_log_probs=True)
    results = generate_static_batch(model, prompts, params, eod_id=EOD, max_sequence_length=32, max_batch_size=4,
                                    vocab_size=VOCAB)
    for prompt, result in zip(prompts, results):
        expected_tokens, expected_log_probs = _full_forward_greedy(model, prompt)
        assert result.generated_tokens == expected_tokens
        torch.testing.assert_close(torch.tensor(result.generated_log_probs), torch.tensor(expected_log_probs),
                                   rtol=0, atol=1e-5)


def test_the_context_keeps_and_reorders_each_rows_state():
    context = StaticInferenceContext(max_batch_size=3, max_sequence_length=8)
    conv, ssm = context.mamba_states(1, 2, (3, 5), (2, 4, 6), torch.float32, "cpu")
    assert conv.shape == (2, 3, 5) and ssm.shape == (2, 2, 4, 6) and not conv.any() and not ssm.any()
    context.store_mamba_states(1, torch.ones(2, 3, 5), torch.arange(2.0).reshape(2, 1, 1, 1).expand(2, 2, 4, 6))
    context.increment_sequence_len_offset(4)
    conv, ssm = context.mamba_states(1, 2, (3, 5), (2, 4, 6), torch.float32, "cpu")
    assert conv.all() and ssm[0].eq(0).all() and ssm[1].eq(1).all()
    context.swap_key_value_dict([1, 0])
    assert context.mamba_states(1, 2, (3, 5), (2, 4, 6), torch.float32, "cpu")[1][0].eq(1).all()
    context.reset()  # a new batch starts from zeros
    assert not context.mamba_states(1, 2, (3, 5), (2, 4, 6), torch.float32, "cpu")[1].any()
