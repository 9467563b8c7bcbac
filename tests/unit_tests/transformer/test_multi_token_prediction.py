"""Multi-token prediction: each depth's loss and the MTP loss of a tiny GPTModel equal a reference written here
with plain tensor ops (shifted-token embedding, norms, concatenation, projection, the depth's transformer layer
called directly, the shared output layer, shifted labels and loss mask), for one and two depths; the shared word
embedding's gradient takes the MTP path's contribution; the main loss is unchanged by adding MTP; under context
parallelism the loss term and its gradient are those of the whole sequence; and the flags' rules (config, layout
`m`, command line) stop with messages naming the flags.

Training-level checks (TP / DP / PP runs, logging, checkpoint resume) are in
tests/unit_tests/training/test_multi_token_prediction_training.py.
"""

import argparse
import json

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.transformer.context_parallel import context_parallel_loss, local_rows
from megatron.core.transformer.multi_token_prediction import (
    clear_mtp_loss_tracker,
    masked_depth_losses,
    mtp_loss_for_backward,
    reduce_mtp_losses_for_logging,
    shift_left,
    track_mtp_losses,
)
from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
from megatron.core.transformer.pipeline_split import virtual_stage_layer_counts
from tests.unit_tests.models.gpt.gpt_test_utils import fixed_batch, seeded_model, tiny_config
from tests.unit_tests.multiprocess_harness import run_on_ranks

SCALING_FACTOR = 0.3
TOLERANCE = 1e-6
# (config fields, model kwargs) per number of depths: LayerNorm + tied for one depth, RMSNorm + SwiGLU + untied
# for two.
VARIANTS = {
    1: ({"normalization": "LayerNorm"}, {}),
    2: ({"normalization": "RMSNorm", "gated_linear_unit": True, "ffn_hidden_size": 48},
        {"share_embeddings_and_output_weights": False}),
}


def _norm(x, norm, config):
    if config.normalization == "RMSNorm":
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.layernorm_epsilon) * norm.weight
    mean = x.mean(-1, keepdim=True)
    variance = (x - mean).pow(2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(variance + config.layernorm_epsilon) * norm.weight + norm.bias


def _reference(model, tokens, labels, position_ids, loss_mask, detach_mtp_embedding=False):
    """(MTP loss, [depth k's per-token loss on its first s - k positions]) with plain ops on the model's
    weights; h^0 is the model's own decoder output (the main model is checked in models/gpt/test_gpt_model.py)."""
    config = model.config
    batch, seq = tokens.shape
    angles = model.rotary_pos_emb(seq, device=tokens.device) if model.position_embedding_type == "rope" else None
    hidden = model.decoder(model.embedding(tokens, position_ids), rotary_pos_emb=angles)  # h^0, [s, b, h]
    word_embedding = model.embedding.word_embeddings.weight
    output_weight = word_embedding if model.output_layer.weight is None else model.output_layer.weight
    depth_losses, total = [], 0.0
    for depth, layer in enumerate(model.mtp.layers, start=1):
        shifted_ids = torch.cat([tokens[:, depth:], torch.zeros(batch, depth, dtype=tokens.dtype)], dim=1)
        table = word_embedding.detach() if detach_mtp_embedding else word_embedding
        embedded = F.embedding(shifted_ids, table).transpose(0, 1)
        combined = torch.cat([_norm(embedded, layer.enorm, config), _norm(hidden, layer.hnorm, config)], dim=-1)
        projected = combined @ layer.eh_proj.weight.t()
        hidden = _norm(layer.transformer_layer(projected, rotary_pos_emb=angles)[0], layer.final_layernorm, config)
        logits = (hidden @ output_weight.t()).transpose(0, 1)[:, : seq - depth]  # [b, s - k, vocab]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, depth:].reshape(-1),
                               reduction="none").view(batch, seq - depth)
        mask = loss_mask[:, depth:]
        depth_losses.append(loss)
        total = total + (loss * mask).sum() / mask.sum()
    return SCALING_FACTOR / len(model.mtp.layers) * total, depth_losses


def _loss_mask(tokens):
    generator = torch.Generator().manual_seed(3)
    return (torch.rand(tokens.shape, generator=generator) > 0.25).float()


def _model_against_reference(num_depths, position_embedding_type="rope"):
    config_fields, model_kwargs = VARIANTS[num_depths]
    parallel_state.initialize_model_parallel()
    try:
        tokens, labels, position_ids = fixed_batch()
        loss_mask = _loss_mask(tokens)
        model = seeded_model(tiny_config(mtp_num_layers=num_depths, **config_fields),
                             position_embedding_type=position_embedding_type, **model_kwargs)
        plain = seeded_model(tiny_config(**config_fields), position_embedding_type=position_embedding_type,
                             **model_kwargs)
        main_loss, depth_losses = model(tokens, position_ids, labels=labels)
        sums, counts = masked_depth_losses(depth_losses, loss_mask)
        mtp_loss = mtp_loss_for_backward(sums, counts, SCALING_FACTOR, 1.0, per_token_loss=False)
        reference_loss, reference_depths = _reference(model, tokens, labels, position_ids, loss_mask)
        seq = tokens.shape[1]
        result = {
            "mtp_loss": mtp_loss.item(),
            "reference_loss": reference_loss.item(),
            "main_loss_diff": (main_loss - plain(tokens, position_ids, labels=labels)).abs().max().item(),
            "depth_diffs": [(depth_losses[k][:, : seq - k - 1] - ref).abs().max().item()
                            for k, ref in enumerate(reference_depths)],
            "tails": [depth_losses[k][:, seq - k - 1:].abs().max().item() for k in range(num_depths)],
        }
        # Gradients of the shared word embedding: the model's MTP loss against the reference's, and against the
        # reference with the shifted tokens' embedding cut off (what the MTP path itself contributes).
        word_embedding = model.embedding.word_embeddings.weight
        mtp_grad, = torch.autograd.grad(mtp_loss, word_embedding)
        reference_grad, = torch.autograd.grad(reference_loss, word_embedding)
        without_mtp_embedding, = torch.autograd.grad(
            _reference(model, tokens, labels, position_ids, loss_mask, detach_mtp_embedding=True)[0],
            word_embedding)
        result["grad_diff"] = (mtp_grad - reference_grad).abs().max().item()
        result["grad_scale"] = reference_grad.abs().max().item()
        result["mtp_embedding_contribution"] = (reference_grad - without_mtp_embedding).abs().max().item()
        return result
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("num_depths, position_embedding_type", [(1, "rope"), (2, "rope"), (1, "none")])
def test_mtp_loss_and_gradient_match_plain_torch_reference(num_depths, position_embedding_type):
    (result,) = run_on_ranks(1, _model_against_reference, num_depths, position_embedding_type)
    assert result["mtp_loss"] == pytest.approx(result["reference_loss"], abs=TOLERANCE, rel=0)
    assert max(result["depth_diffs"]) < TOLERANCE, result["depth_diffs"]
    assert max(result["tails"]) == 0.0  # the shifted label fell off the end: masked out
    assert result["main_loss_diff"] == 0.0  # adding MTP leaves the main model (weights and loss) as it was
    assert result["grad_diff"] < TOLERANCE * max(1.0, result["grad_scale"])
    assert result["mtp_embedding_contribution"] > 1e-3 * result["grad_scale"]


def test_shift_left_and_masked_depth_losses():
    values = torch.arange(1.0, 7.0).view(1, 6)
    assert shift_left(values, 2).tolist() == [[3.0, 4.0, 5.0, 6.0, 0.0, 0.0]]
    assert shift_left(values, 9).tolist() == [[0.0] * 6]
    depth_losses = torch.stack([values, 2 * values])  # N = 2
    loss_mask = torch.tensor([[1.0, 1.0, 0.0, 1.0, 1.0, 1.0]])
    sums, counts = masked_depth_losses(depth_losses, loss_mask)
    # depth 1: mask shifted by one = [1, 0, 1, 1, 1, 0]; depth 2: [0, 1, 1, 1, 0, 0]
    assert sums.tolist() == [1 + 3 + 4 + 5, 2 * (2 + 3 + 4)] and counts.tolist() == [4.0, 3.0]
    mean_term = mtp_loss_for_backward(sums, counts, 0.1, torch.tensor(5.0), per_token_loss=False)
    assert mean_term.item() == pytest.approx(0.1 / 2 * (13 / 4 + 18 / 3) * 5)
    per_token_term = mtp_loss_for_backward(sums, counts, 0.1, torch.tensor(5.0), per_token_loss=True)
    assert per_token_term.item() == pytest.approx(0.1 / 2 * (13 + 18))


def test_masked_depth_losses_shift_within_packed_sequences():
    """Two packed sequences of 3 tokens: depth k's mask is each sequence's own mask shifted by k, so the rows whose
    shifted label lies in the next sequence count for nothing."""
    from megatron.core.packed_seq_params import PackedSeqParams

    values = torch.arange(1.0, 7.0).view(1, 6)
    depth_losses = torch.stack([values, 2 * values])
    params = PackedSeqParams(cu_seqlens_q=torch.tensor([0, 3, 6]))
    sums, counts = masked_depth_losses(depth_losses, torch.ones(1, 6), packed_seq_params=params)
    # depth 1: rows 0, 1 and 3, 4 ([1, 1, 0, 1, 1, 0]); depth 2: rows 0 and 3
    assert sums.tolist() == [1 + 2 + 4 + 5, 2 * (1 + 4)] and counts.tolist() == [4.0, 2.0]
    assert masked_depth_losses(depth_losses, torch.ones(1, 6))[1].tolist() == [5.0, 4.0]  # across the boundary



def test_a_depth_without_tokens_is_left_out_of_the_logged_mean(tmp_path, capsys):
    """A batch whose loss mask keeps only the first two of six positions leaves depth 2 (mask shifted by two) no
    token: its logged loss is None, not 0/0 = NaN, and the log line's mean over the interval is that of the
    iteration that had tokens, as for `lm loss`; the metrics file records null."""
    from megatron.training.training_log import TrainingLogger

    depth_losses = torch.arange(1.0, 13.0).view(2, 1, 6)
    no_depth_two = masked_depth_losses(depth_losses, torch.tensor([[1.0, 1.0, 0.0, 0.0, 0.0, 0.0]]))
    all_tokens = masked_depth_losses(depth_losses, torch.ones(1, 6))
    assert no_depth_two[1].tolist() == [1.0, 0.0]
    clear_mtp_loss_tracker()
    track_mtp_losses(*no_depth_two)
    assert reduce_mtp_losses_for_logging(2, "cpu") == {"mtp_1 loss": 1.0, "mtp_2 loss": None}

    args = argparse.Namespace(metrics_file=str(tmp_path / "metrics.jsonl"), tensorboard_dir=None, save=None,
                              log_interval=2, train_iters=2, tensorboard_log_interval=1,
                              log_memory_to_tensorboard=False, log_throughput=False, log_timers_to_tensorboard=False,
                              world_size=1, mtp_num_layers=2, device="cpu")
    logger = TrainingLogger(args, is_logging_rank=True)
    memory = {"on_gpu": False, "params_bytes": 1, "grads_bytes": 1, "optimizer_state_bytes": 1,
              "allocated_bytes": 3, "peak_bytes": 3}
    for iteration, (sums, counts) in ((1, no_depth_two), (2, all_tokens)):
        track_mtp_losses(sums, counts)
        logger.log_iteration({"iteration": iteration, "rank": 0, "losses": {"lm loss": 1.0}, "learning_rate": 0.1,
                              "loss_scale": 1.0, "grad_norm": None, "num_zeros": None, "skipped": False,
                              "nan": False, "iteration_time_s": 0.1, "consumed_samples": iteration,
                              "global_batch_size": 1, "memory": memory})
    logger.close()
    line = [text for text in capsys.readouterr().out.splitlines() if text.startswith("iteration ")][0]
    # depth 1: 1 (position 0 only), then (1 + ... + 5) / 5 = 3; depth 2: (7 + ... + 10) / 4 = 8.5 only
    assert "| lm loss: 1.000E+00 | mtp_1 loss: 2.000E+00 | mtp_2 loss: 8.500E+00 |" in line
    records = [json.loads(text) for text in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [record["mtp_2 loss"] for record in records] == [None, 8.5]

def _mtp_objective_gradient_under_cp():
    """LM and two depths' per-token losses as leaves, a loss mask that leaves the CP ranks uneven counts: the
    objective this rank back-propagates (`masked_depth_losses` and `mtp_loss_for_backward` on its two chunks,
    then `context_parallel_loss`), its gradients averaged over CP as the wrappers do, against
    LM mean + F / N * sum_k mean_k computed on the whole sequence with plain tensor ops."""
    cp_size, cp_rank, group = dist.get_world_size(), dist.get_rank(), dist.group.WORLD
    generator = torch.Generator().manual_seed(5)
    lm_losses, depth_losses = torch.rand(1, 16, generator=generator), torch.rand(2, 1, 16, generator=generator)
    mask = torch.ones(1, 16)
    mask[0, 5:11] = 0.0  # rank 0 holds positions 0-3 and 12-15, rank 1 positions 4-11
    full_lm, full_depths = lm_losses.clone().requires_grad_(), depth_losses.clone().requires_grad_()
    objective = (full_lm * mask).sum() / mask.sum()
    for depth in (1, 2):
        shifted_mask = torch.cat([mask[:, depth:], torch.zeros(1, depth)], dim=1)
        objective = objective + SCALING_FACTOR / 2 * (full_depths[depth - 1] * shifted_mask).sum() / shifted_mask.sum()
    objective.backward()
    local_lm = local_rows(lm_losses, 1, cp_size, cp_rank).clone().requires_grad_()
    local_depths = local_rows(depth_losses, 2, cp_size, cp_rank).clone().requires_grad_()
    local_mask = local_rows(mask, 1, cp_size, cp_rank)
    num_tokens = local_mask.sum()
    sums, counts = masked_depth_losses(local_depths, local_mask, cp_group=group)
    loss_sum = (local_lm * local_mask).sum() + mtp_loss_for_backward(sums, counts, SCALING_FACTOR, num_tokens,
                                                                     per_token_loss=False, cp_group=group)
    loss_sum, count = context_parallel_loss(loss_sum, num_tokens, group, per_token_loss=False)
    reported = (loss_sum / count).detach().clone()
    dist.all_reduce(reported)  # the CP-averaged objective
    (loss_sum / count).backward()
    errors = [(local_lm.grad / cp_size - local_rows(full_lm.grad, 1, cp_size, cp_rank)).abs().max().item(),
              (local_depths.grad / cp_size - local_rows(full_depths.grad, 2, cp_size, cp_rank)).abs().max().item()]
    return (reported / cp_size).item(), objective.item(), errors, counts.tolist()


@pytest.mark.parametrize("world_size", [2])
def test_mtp_loss_and_gradient_under_context_parallelism_are_the_whole_sequences(world_size):
    results = run_on_ranks(world_size, _mtp_objective_gradient_under_cp)
    # Each rank's tokens under the mask shifted by 1 (0 at positions 4-9 and 15) and by 2 (3-8, 14 and 15).
    assert [counts for *_, counts in results] == [[7.0, 5.0], [2.0, 3.0]]
    for reported, expected, errors, _ in results:
        assert reported == pytest.approx(expected, rel=1e-6)
        assert max(errors) < 1e-7, errors


# --------------------------------------------------------------------------------------------------------
# Rules
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"mtp_num_layers": 0}, r"--mtp-num-layers must be an integer >= 1"),
        ({"mtp_num_layers": 1, "mtp_loss_scaling_factor": -1.0}, r"--mtp-loss-scaling-factor must be"),
        ({"mtp_num_layers": 2, "pipeline_model_parallel_size": 2, "pipeline_model_parallel_layout": "Et|tmL"},
         r"places 1 multi-token-prediction depths \('m'\) but --mtp-num-layers is 2"),
        ({"pipeline_model_parallel_size": 2, "pipeline_model_parallel_layout": "Et|tmL"},
         r"places 1 multi-token-prediction depths \('m'\) but --mtp-num-layers is unset"),
        ({"mtp_num_layers": 1, "pipeline_model_parallel_size": 2, "pipeline_model_parallel_layout": "Et|mtL"},
         r"must all sit in the last stage, after its transformer layers and just before the loss"),
    ],
)
def test_config_rules_name_the_flags(fields, message):
    with pytest.raises(ValueError, match=message):
        tiny_config(**fields)


def test_context_parallelism_is_accepted():
    from megatron.training.argument_groups import mtp

    assert tiny_config(mtp_num_layers=2, context_parallel_size=2).mtp_num_layers == 2
    mtp.validate(_args(context_parallel_size=2))


def test_layout_with_mtp_depths_splits_only_transformer_layers():
    layout = PipelineParallelLayerLayout("Et|(tt|)*2tmmL", 2)
    assert virtual_stage_layer_counts(6, 2, 2, layout=layout, mtp_num_layers=2) == (1, 2, 2, 1)
    assert layout.mtp_layer_count() == 2


def test_model_needs_rotary_or_no_position_embeddings():
    from megatron.core.models.gpt.gpt_model import GPTModel

    with pytest.raises(ValueError, match=r"--mtp-num-layers needs --position-embedding-type rope or none"):
        GPTModel(tiny_config(mtp_num_layers=1), vocab_size=64, max_sequence_length=16,
                 share_embeddings_and_output_weights=True)


def _args(**overrides):
    fields = dict(mtp_num_layers=1, mtp_loss_scaling_factor=0.1, position_embedding_type="rope",
                  context_parallel_size=1, pipeline_model_parallel_layout=None, pipeline_model_parallel_size=2,
                  num_layers=4)
    fields.update(overrides)
    return argparse.Namespace(**fields)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"mtp_num_layers": 0}, r"--mtp-num-layers must be >= 1"),
        ({"position_embedding_type": "learned_absolute"}, r"--mtp-num-layers needs --position-embedding-type rope or "),
        ({"mtp_num_layers": None, "pipeline_model_parallel_layout": "Ett|ttmL"},
         r"places multi-token-prediction depths \('m'\): add --mtp-num-layers"),
        ({"mtp_num_layers": 2, "pipeline_model_parallel_layout": "Ett|ttmL"},
         r"places 1 multi-token-prediction depths \('m'\) but --mtp-num-layers is 2"),
    ],
)
def test_command_line_rules_name_the_flags(overrides, message):
    from megatron.training.argument_groups import mtp

    with pytest.raises(ValueError, match=message):
        mtp.validate(_args(**overrides))
    mtp.validate(_args(pipeline_model_parallel_layout="Ett|ttmL"))  # the matching layout passes
    mtp.validate(_args(position_embedding_type="none"))  # no position embeddings, as upstream allows
