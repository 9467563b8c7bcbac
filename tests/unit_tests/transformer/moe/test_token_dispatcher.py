"""The token dispatchers built as upstream builds them, (num_local_experts, local_expert_indices, config), on one
rank: dispatch groups the tokens by expert, combine sums probability x expert output back into each token."""

import pytest
import torch

from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher, MoEAlltoAllTokenDispatcher
from megatron.core.transformer.transformer_config import TransformerConfig


@pytest.mark.parametrize("dispatcher_class", [MoEAllGatherTokenDispatcher, MoEAlltoAllTokenDispatcher])
def test_upstream_constructor_dispatch_and_combine(dispatcher_class):
    config = TransformerConfig(num_layers=1, hidden_size=2, num_attention_heads=1, num_moe_experts=3,
                               moe_router_topk=2)
    dispatcher = dispatcher_class(3, [0, 1, 2], config=config)
    hidden = torch.arange(8, dtype=torch.float32).view(2, 2, 2)  # [s, b, h]: tokens 0..3
    routing_map = torch.tensor([[1, 1, 0], [0, 1, 1], [1, 0, 1], [1, 1, 0]], dtype=torch.bool)
    probs = torch.tensor([[0.75, 0.25, 0.0], [0.0, 0.5, 0.5], [0.125, 0.0, 0.875], [0.5, 0.5, 0.0]])
    tokens, tokens_per_expert = dispatcher.dispatch(hidden, probs, routing_map)
    flat = hidden.view(4, 2)
    assert tokens_per_expert.tolist() == [3, 3, 2]
    assert torch.equal(tokens, flat[[0, 2, 3, 0, 1, 3, 1, 2]])
    # Expert e doubles (e = 0), triples (1) or negates (2) its tokens.
    factors = torch.tensor([2.0] * 3 + [3.0] * 3 + [-1.0] * 2).unsqueeze(-1)
    output = dispatcher.combine(tokens * factors)
    expected = (probs * torch.tensor([2.0, 3.0, -1.0])).sum(dim=1, keepdim=True) * flat
    torch.testing.assert_close(output, expected.view(2, 2, 2))
    with pytest.raises(ValueError, match="pg_collection"):
        dispatcher_class(3, [0, 1, 2], config, pg_collection=object())
