"""A GPT with MoE layers trains on one rank (no data-parallel wrapper): with one expert and top-1 routing it is
the dense GPT (the expert's probability is 1), step for step; with four experts, top-2 and the auxiliary losses,
its loss falls. `--moe-layer-freq` decides which layers are MoE. Grouped-GEMM experts under full recompute repeat
bit for bit."""

import re

import torch

from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.models.gpt.gpt_test_utils import fixed_batch

VOCAB, MAX_LENGTH, STEPS = 64, 16, 4
SHAPE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, hidden_dropout=0.0, attention_dropout=0.0,
             init_seed=1234)


def _model(**overrides):
    model_parallel_cuda_manual_seed(1234)
    return GPTModel(TransformerConfig(**SHAPE, **overrides), vocab_size=VOCAB, max_sequence_length=MAX_LENGTH,
                    share_embeddings_and_output_weights=True)


def _train(model, steps=STEPS):
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    tokens, labels, position_ids = fixed_batch(seed=3, batch=2, seq=16, vocab=VOCAB)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = model(tokens, position_ids, labels=labels).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_one_expert_top1_trains_like_the_dense_model():
    moe = _model(num_moe_experts=1, moe_router_topk=1, moe_router_pre_softmax=True, ffn_hidden_size=48,
                 moe_layer_freq=2)
    assert isinstance(moe.decoder.layers[0].mlp, MoELayer) and isinstance(moe.decoder.layers[1].mlp, MLP)
    dense = _model(ffn_hidden_size=48)
    dense_state = dense.state_dict()
    for name, value in moe.state_dict().items():
        target = re.sub(r"mlp\.experts\.local_experts\.0\.", "mlp.", name)
        if target in dense_state:
            dense_state[target] = value.clone()
    dense.load_state_dict(dense_state)
    moe_losses, dense_losses = _train(moe), _train(dense)
    for moe_loss, dense_loss in zip(moe_losses, dense_losses):
        assert abs(moe_loss - dense_loss) <= 1e-5 * abs(dense_loss), (moe_losses, dense_losses)
    assert dense_losses[-1] < dense_losses[0]


def test_four_experts_top2_loss_falls():
    model = _model(num_moe_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3,
                   moe_token_dispatcher_type="alltoall")
    assert all(isinstance(layer.mlp, MoELayer) for layer in model.decoder.layers)
    losses = _train(model)
    assert losses[-1] < losses[0] - 0.1, losses


def test_multi_token_prediction_layer_logs_its_aux_loss_as_a_layer_of_its_own():
    """A multi-token-prediction depth built like the decoder's last (MoE) layer logs its load-balancing loss
    under layer num_layers + depth, and the logged average is over the decoder's and the depth's MoE layers (as
    upstream); each logged value against the switch loss written here from the router's input."""
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.router import TopKRouter

    model_parallel_cuda_manual_seed(1234)
    config = TransformerConfig(**SHAPE, num_moe_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.01,
                               moe_per_layer_logging=True, mtp_num_layers=1)
    model = GPTModel(config, vocab_size=VOCAB, max_sequence_length=MAX_LENGTH, position_embedding_type="rope",
                     share_embeddings_and_output_weights=True)
    routers = [module for module in model.modules() if isinstance(module, TopKRouter)]
    inputs = {}
    for router in routers:
        router.register_forward_hook(lambda module, args, output: inputs.__setitem__(module, args[0].detach()))
    tokens, labels, position_ids = fixed_batch(seed=3, batch=2, seq=16, vocab=VOCAB)
    moe_utils.clear_aux_losses_tracker()
    model(tokens, position_ids, labels=labels)
    expected = []
    for router in routers:
        scores = torch.softmax(inputs[router].reshape(-1, SHAPE["hidden_size"]) @ router.weight.detach().t(), -1)
        counts = torch.zeros_like(scores).scatter(1, scores.topk(2, dim=-1).indices, 1.0).sum(dim=0)
        expected.append(4 / (2 * scores.size(0) ** 2) * (counts * scores.sum(dim=0)).sum().item())
    num_layers, num_moe_layers = moe_utils.aux_loss_layer_counts(2, 1, 1)
    assert (num_layers, num_moe_layers) == (3, 3)
    logged = moe_utils.reduce_aux_losses_for_logging(["load_balancing_loss"], num_layers, num_moe_layers, 1, 1, "cpu")
    assert sorted(logged) == ["load_balancing_loss"] + [f"load_balancing_loss_layer_{i}" for i in range(3)]
    for index, value in enumerate(expected):
        assert abs(logged[f"load_balancing_loss_layer_{index}"] - value) <= 1e-6 * value
    assert abs(logged["load_balancing_loss"] - sum(expected) / 3) <= 1e-6 * sum(expected)
    assert moe_utils.aux_loss_layer_counts(4, "([1]*3+[0]*1)", 2) == (6, 3)  # the depths are dense like layer 4


def _gradients(model, tokens, labels, position_ids):
    model.zero_grad(set_to_none=True)
    loss = model(tokens, position_ids, labels=labels).mean()
    loss.backward()
    return [loss.detach()] + [param.grad.clone() for param in model.parameters()]


def test_grouped_gemm_under_full_recompute_repeats_bit_for_bit_over_two_threads():
    """`--moe-grouped-gemm` with `--recompute-granularity full --recompute-method uniform --recompute-num-layers
    1` at two intra-op threads, with linear biases and 1024 expert rows (fc2's bias gradient sums 1024 x 32 =
    32768 elements, from where CPU kernels split over threads): every step gives the same loss and gradients to
    the bit, equal to those without recompute, and within 1e-6 of sequential experts."""
    moe = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64, moe_aux_loss_coeff=0.01,
               moe_token_dispatcher_type="alltoall", add_bias_linear=True)
    recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    batch = fixed_batch(seed=3, batch=32, seq=MAX_LENGTH, vocab=VOCAB)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        grouped = _model(moe_grouped_gemm=True, **moe, **recompute)
        runs = [_gradients(grouped, *batch) for _ in range(3)]
        kept = _gradients(_model(moe_grouped_gemm=True, **moe), *batch)
        sequential = _gradients(_model(**moe, **recompute), *batch)
    finally:
        torch.set_num_threads(threads)
    for run in runs[1:] + [kept]:
        assert all(torch.equal(got, expected) for got, expected in zip(run, runs[0]))
    for got, expected in zip(runs[0], sequential):
        assert (got - expected).norm() <= 1e-6 * expected.norm()
