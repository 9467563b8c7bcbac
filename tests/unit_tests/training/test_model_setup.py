"""`get_model`: an upstream Megatron-LM model provider (upstream's GPTModel keywords, `vp_stage` per model chunk)
trains under `pretrain()` as pretrain_gpt's does, and upstream's parameter-count line is printed once per
(tensor, pipeline) rank with the rank's parameter count."""

import contextlib
import io
import json
import re
import types

import pytest
import torch

from tests.unit_tests.multiprocess_harness import run_on_ranks

TINY_GPT = (
    "--num-layers 4 --hidden-size 32 --num-attention-heads 2 --seq-length 16 --micro-batch-size 2 "
    "--global-batch-size 4 --lr 1e-2 --lr-decay-style constant --mock-data --vocab-size 127 "
    "--make-vocab-size-divisible-by 64 --hidden-dropout 0 --attention-dropout 0 --num-workers 0 --log-interval 1 "
    "--eval-iters 0 --train-iters 2 --pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2"
)


def upstream_model_provider(pre_process=True, post_process=True, vp_stage=None):
    """pretrain_gpt.py's model_provider as upstream Megatron-LM writes it (local layer spec)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.training.global_vars import get_args
    from megatron.training.model_config import core_transformer_config_from_args

    args = get_args()
    config = core_transformer_config_from_args(args)
    transformer_layer_spec = get_gpt_layer_local_spec(args.num_experts, args.moe_grouped_gemm, args.qk_layernorm,
                                                      args.multi_latent_attention)
    mtp_block_spec = None
    if args.mtp_num_layers is not None:
        mtp_block_spec = get_gpt_mtp_block_spec(config, transformer_layer_spec, use_transformer_engine=False,
                                                vp_stage=vp_stage)
    return GPTModel(
        config=config,
        transformer_layer_spec=transformer_layer_spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
        mtp_block_spec=mtp_block_spec,
        vp_stage=vp_stage,
        scatter_embedding_sequence_parallel=True,
    )


def _pretrain_records(workdir, provider_name):
    import pretrain_gpt
    from megatron.core.enums import ModelType
    from megatron.training.training import pretrain

    chunk_stages = []

    def upstream_provider(pre_process=True, post_process=True, vp_stage=None):
        model = upstream_model_provider(pre_process, post_process, vp_stage)
        chunk_stages.append((vp_stage, model.decoder.layer_offset))
        return model

    provider = upstream_provider if provider_name == "upstream" else pretrain_gpt.model_provider
    metrics = f"{workdir}/{provider_name}.jsonl"
    pretrain(pretrain_gpt.train_valid_test_datasets_provider, provider, ModelType.encoder_or_decoder,
             pretrain_gpt.forward_step, argv=f"{TINY_GPT} --metrics-file {metrics}".split())
    records = [json.loads(line) for line in open(metrics).read().splitlines()]
    return chunk_stages, [(record["lm loss"], record["grad norm"]) for record in records]


@pytest.mark.parametrize("world_size", [2])
def test_upstream_model_provider_trains_under_pretrain(tmp_path, world_size):
    upstream = run_on_ranks(world_size, _pretrain_records, str(tmp_path), "upstream")
    # Each pipeline rank built its two chunks with upstream's vp_stage: chunk c of rank r is virtual stage 2c + r.
    assert [stages for stages, _ in upstream] == [[(0, 0), (1, 2)], [(0, 1), (1, 3)]]
    reference = run_on_ranks(world_size, _pretrain_records, str(tmp_path), "pretrain_gpt")
    upstream_steps, reference_steps = upstream[0][1], reference[0][1]
    assert len(upstream_steps) == 2 and upstream_steps[1][0] != upstream_steps[0][0]  # the first step trained
    assert upstream_steps == reference_steps  # same weights, same losses and gradient norms


# Parameters of tiny_config (L = 2 layers, hidden h = 32, ffn f = 4h, LayerNorm with bias, linear biases) with a
# 64-token vocabulary V, 16 learned positions S and tied embeddings; TP = t. Upstream counts every parameter a rank
# holds, so a replicated one counts once per tensor-parallel rank.
L, H, F, V, S = 2, 32, 128, 64, 16


def expected_parameters_over_tp_ranks(t):
    layer = (2 * H * t  # input norm (replicated)
             + 3 * H * H + 3 * H  # QKV weight and bias (column parallel)
             + H * H + H * t  # attention output weight (row parallel) and its replicated bias
             + 2 * H * t  # pre-MLP norm (replicated)
             + F * H + F  # fc1 weight and bias (column parallel)
             + H * F + H * t)  # fc2 weight (row parallel) and its replicated bias
    return V * H + S * H * t + L * layer + 2 * H * t  # + word and position embeddings, final norm


def _parameter_count_lines(tp):
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.training.model_setup import get_model
    from tests.unit_tests.models.gpt.gpt_test_utils import tiny_config

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    args = types.SimpleNamespace(virtual_pipeline_model_parallel_size=None, seed=1234, device=torch.device("cpu"))

    def provider(pre_process=True, post_process=True):
        return GPTModel(tiny_config(tp=tp), vocab_size=V, max_sequence_length=S, pre_process=pre_process,
                        post_process=post_process, share_embeddings_and_output_weights=True)

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        chunks = get_model(provider, args, wrap_with_ddp=False)
    held = sum(param.nelement() for chunk in chunks for param in chunk.parameters())
    rank = parallel_state.get_tensor_model_parallel_rank()
    parallel_state.destroy_model_parallel()
    return printed.getvalue(), held, rank


LINE = re.compile(r"^ > number of parameters on \(tensor, pipeline\) model parallel rank \((\d+), (\d+)\): (\d+)$")


@pytest.mark.parametrize("world_size", [2])
def test_parameter_count_line_per_model_parallel_rank(world_size):
    # TP = 2: both ranks are data-parallel rank 0 and print their own count.
    counts = []
    for printed, held, rank in run_on_ranks(world_size, _parameter_count_lines, 2):
        lines = printed.splitlines()
        assert len(lines) == 1 and LINE.match(lines[0]), printed
        tensor_rank, pipeline_rank, count = map(int, LINE.match(lines[0]).groups())
        assert (tensor_rank, pipeline_rank, count) == (rank, 0, held)
        counts.append(count)
    assert sum(counts) == expected_parameters_over_tp_ranks(2)
    # TP = 1, DP = 2: only data-parallel rank 0 prints, the whole model.
    (printed_0, held_0, _), (printed_1, _, _) = run_on_ranks(world_size, _parameter_count_lines, 1)
    assert printed_0 == f" > number of parameters on (tensor, pipeline) model parallel rank (0, 0): {held_0}\n"
    assert held_0 == expected_parameters_over_tp_ranks(1) and printed_1 == ""
