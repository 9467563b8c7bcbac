"""Fine-grained activation offloading (`--fine-grained-activation-offloading --offload-modules ...`): two training
steps give the losses and gradients of a run without offload (exact, fp32) for dense, multi-latent-attention and
MoE GPTs; the offloader saw tensors of exactly the requested pieces of every layer, never a weight, and gave every
one back; the size threshold keeps small tensors; evaluation offloads nothing; the rules; the flags; and a
Megatron-FSDP pretrain() run trains the losses of the same run without offload."""

import functools

import pytest
import torch

from megatron.core.offloading.fine_grained import OFFLOADABLE_MODULES
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.distributed.precision_gpt import HIDDEN, MICRO_BATCH, SEQ, VOCAB, gpt_batch, gpt_loss
from tests.unit_tests.multiprocess_harness import run_on_ranks
from tests.unit_tests.offloading.training_steps import assert_same_training, losses_and_gradients

NUM_LAYERS, STEPS = 2, 2
DENSE_MODULES = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm")
MODELS = {
    "dense": (),
    "mla": (("multi_latent_attention", True), ("q_lora_rank", 10), ("kv_lora_rank", 12), ("qk_head_dim", 6),
            ("qk_pos_emb_head_dim", 16), ("v_head_dim", 10)),
    "moe": (("num_moe_experts", 4), ("moe_router_topk", 2), ("moe_ffn_hidden_size", 48)),
    "moe_grouped_gemm": (("num_moe_experts", 4), ("moe_router_topk", 2), ("moe_ffn_hidden_size", 48),
                         ("moe_grouped_gemm", True)),
}
ACTIVATION_BYTES = SEQ * MICRO_BATCH * HIDDEN * 4  # one fp32 [s, b, h] tensor
ROUTED_ROWS = SEQ * MICRO_BATCH * 2  # tokens x top-2


def _gpt(model, modules=(), min_size=0):
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(1234)
    offload = dict(fine_grained_activation_offloading=True, offload_modules=modules,
                   min_offloaded_tensor_size=min_size) if modules else {}
    config = TransformerConfig(num_layers=NUM_LAYERS, hidden_size=HIDDEN, num_attention_heads=4, hidden_dropout=0.0,
                               attention_dropout=0.0, init_seed=1234, **dict(MODELS[model]), **offload)
    return GPTModel(config, vocab_size=VOCAB, max_sequence_length=SEQ, share_embeddings_and_output_weights=True)


@functools.cache
def _train(model, modules=(), min_size=0):
    """(losses, gradients, (packed, unpacked, packed bytes) per label and the labels in their first forward's
    order) of two steps; no counters without offload."""
    gpt = _gpt(model, modules, min_size)
    losses, grads = losses_and_gradients(gpt, STEPS, lambda gpt, step: gpt_loss(gpt, gpt_batch(step)))
    offloader = gpt.decoder.activation_offloader
    counts = None if offloader is None else (dict(offloader.packed), dict(offloader.unpacked),
                                              dict(offloader.packed_bytes), list(offloader._label_order))
    return losses, grads, counts


def _check_same_as_without_offload(model, modules, min_size=0):
    (plain_losses, plain_grads, none), (losses, grads, counts) = _train(model), _train(model, modules, min_size)
    assert none is None
    assert_same_training((plain_losses, plain_grads), (losses, grads))
    packed, unpacked, packed_bytes, label_order = counts
    # Every layer offloaded the requested pieces, and only those, under labels in forward order (the prefetch
    # reloads the label before the one whose backward starts); every tensor came back for the backward.
    assert label_order == [(layer, piece) for layer in range(1, NUM_LAYERS + 1) for piece in OFFLOADABLE_MODULES
                           if piece in modules]
    assert sorted(packed) == sorted(label_order)
    assert all(count > 0 for count in packed.values()) and packed == unpacked
    return packed, packed_bytes


@pytest.mark.parametrize("modules", [DENSE_MODULES] + [(name,) for name in DENSE_MODULES],
                         ids=["all"] + list(DENSE_MODULES))
def test_dense_gpt_trains_the_same_with_its_pieces_offloaded(modules):
    packed, packed_bytes = _check_same_as_without_offload("dense", modules)
    for layer in range(1, NUM_LAYERS + 1):
        if "attn_norm" in modules:  # LayerNorm: its input, mean and rstd (the weights stay)
            assert packed[layer, "attn_norm"] == 3 * STEPS
            assert packed_bytes[layer, "attn_norm"] == STEPS * (ACTIVATION_BYTES + 2 * SEQ * MICRO_BATCH * 4)
        for linear in ("qkv_linear", "attn_proj"):  # F.linear keeps its input and weight.t(), a weight
            if linear in modules:
                assert (packed[layer, linear], packed_bytes[layer, linear]) == (STEPS, STEPS * ACTIVATION_BYTES)


def test_multi_latent_attention_offloads_its_four_projections():
    packed, _ = _check_same_as_without_offload("mla", ("qkv_linear", "core_attn"))
    # The inputs of linear_q_down_proj, linear_q_up_proj, linear_kv_down_proj and linear_kv_up_proj.
    assert packed[1, "qkv_linear"] == packed[2, "qkv_linear"] == 4 * STEPS


@pytest.mark.parametrize("model", ["moe", "moe_grouped_gemm"])
@pytest.mark.parametrize("modules", [("expert_fc1", "moe_act"), ("expert_fc1",), ("moe_act",)])
def test_moe_gpt_trains_the_same_with_its_experts_offloaded(model, modules):
    from megatron.core.transformer.moe.experts import grouped_mm_supported

    packed, packed_bytes = _check_same_as_without_offload(model, modules)
    if "expert_fc1" not in modules:
        return
    # fc1's input, every routed row once; the weights (the grouped path's stacked copy too) stay.
    fc1_input_bytes = ROUTED_ROWS * HIDDEN * 4
    if model == "moe":
        assert packed_bytes[1, "expert_fc1"] == STEPS * fc1_input_bytes
    else:
        assert grouped_mm_supported("cpu", torch.float32)  # the grouped path ran
        # Besides the input: the group offsets (4 x int32) and each row's expert (int64), for fc1's bias.
        assert packed_bytes[1, "expert_fc1"] == STEPS * (fc1_input_bytes + 4 * 4 + ROUTED_ROWS * 8)


def test_small_tensors_stay_on_the_device():
    """With the threshold at one activation's size, the norm offloads its input only (not its mean and rstd)."""
    packed, packed_bytes = _check_same_as_without_offload("dense", ("attn_norm",), min_size=SEQ * MICRO_BATCH * HIDDEN)
    assert packed[1, "attn_norm"] == STEPS and packed_bytes[1, "attn_norm"] == STEPS * ACTIVATION_BYTES



def _train_with_multi_token_prediction(modules):
    """Two steps of a GPT with one MTP depth, on LM loss + MTP loss: (losses, gradients, the MTP layer's
    (packed, unpacked, labels) or None)."""
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(1234)
    offload = dict(fine_grained_activation_offloading=True, offload_modules=modules,
                   min_offloaded_tensor_size=0) if modules else {}
    config = TransformerConfig(num_layers=NUM_LAYERS, hidden_size=HIDDEN, num_attention_heads=4, hidden_dropout=0.0,
                               attention_dropout=0.0, init_seed=1234, mtp_num_layers=1, **offload)
    gpt = GPTModel(config, vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="rope",
                   share_embeddings_and_output_weights=True)

    def lm_and_mtp_loss(gpt, step):
        batch = gpt_batch(step)
        main, (depth,) = gpt(batch["tokens"], batch["position_ids"], labels=batch["labels"])
        return main.float().mean() + depth.float().mean()

    losses, grads = losses_and_gradients(gpt, STEPS, lm_and_mtp_loss)
    offloader = gpt.mtp.layers[0].activation_offloader
    counts = None if offloader is None else (dict(offloader.packed), dict(offloader.unpacked),
                                              list(offloader._label_order))
    return losses, grads, counts


def test_multi_token_prediction_layers_offload_their_pieces_too():
    modules = ("attn_norm", "core_attn", "attn_proj")
    (plain_losses, plain_grads, none), (losses, grads, counts) = (_train_with_multi_token_prediction(()),
                                                                  _train_with_multi_token_prediction(modules))
    assert none is None
    assert_same_training((plain_losses, plain_grads), (losses, grads))
    packed, unpacked, labels = counts
    # The depth's layer (numbered as the decoder's last) has an offloader of its own.
    assert labels == [(NUM_LAYERS, piece) for piece in modules]
    assert all(count > 0 for count in packed.values()) and packed == unpacked

def test_evaluation_offloads_nothing():
    gpt = _gpt("moe", OFFLOADABLE_MODULES)
    offloader = gpt.decoder.activation_offloader
    with torch.no_grad():
        gpt_loss(gpt, gpt_batch(0))
    gpt.eval()
    gpt_loss(gpt, gpt_batch(0))  # gradients enabled, evaluation mode
    assert dict(offloader.packed) == {}
    gpt.train()
    gpt_loss(gpt, gpt_batch(0)).backward()
    assert {piece for _, piece in offloader.packed} == set(OFFLOADABLE_MODULES)


FINE = dict(fine_grained_activation_offloading=True)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (FINE, r"--fine-grained-activation-offloading needs --offload-modules"),
        (dict(offload_modules=("core_attn",)), r"--offload-modules needs --fine-grained-activation-offloading"),
        (dict(FINE, offload_modules=("attention",)), r"--offload-modules: unknown attention"),
        (dict(FINE, offload_modules=("core_attn",), cpu_offloading=True, cpu_offloading_num_layers=1),
         r"--fine-grained-activation-offloading and --cpu-offloading"),
        (dict(FINE, offload_modules=("core_attn",), recompute_granularity="selective"),
         r"--fine-grained-activation-offloading does not work with --recompute-granularity"),
        (dict(FINE, offload_modules=("core_attn", "moe_act")), r"--offload-modules moe_act .* needs --num-experts"),
        (dict(FINE, offload_modules=("expert_fc1",), num_moe_experts=2, moe_layer_recompute=True),
         r"--offload-modules expert_fc1 does not work with --moe-layer-recompute"),
        (dict(FINE, offload_modules=("core_attn",), min_offloaded_tensor_size=-1),
         r"--min-offloaded-tensor-size must be >= 0"),
    ],
)
def test_config_rules_name_the_flags(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, **kwargs)


def test_pipeline_parallelism_is_refused():
    with pytest.raises(ValueError, match=r"--fine-grained-activation-offloading does not support "
                                         r"--pipeline-model-parallel-size > 1"):
        TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, pipeline_model_parallel_size=2,
                          pipeline_dtype=torch.float32, **FINE, offload_modules=("core_attn",))


def test_flags_reach_the_transformer_config():
    from megatron.training.model_config import core_transformer_config_from_args
    from tests.unit_tests.training.test_arguments import validated

    config = core_transformer_config_from_args(validated(
        "--fine-grained-activation-offloading --offload-modules core_attn attn_proj --min-offloaded-tensor-size 0"))
    assert (config.fine_grained_activation_offloading, config.offload_modules, config.min_offloaded_tensor_size) == (
        True, ("core_attn", "attn_proj"), 0)
    default = core_transformer_config_from_args(validated(""))
    assert (default.fine_grained_activation_offloading, default.offload_modules,
            default.min_offloaded_tensor_size) == (False, (), 1024 * 1024)
    with pytest.raises(ValueError, match="--offload-modules needs --fine-grained-activation-offloading"):
        core_transformer_config_from_args(validated("--offload-modules core_attn"))
    with pytest.raises(SystemExit):
        validated("--fine-grained-activation-offloading --offload-modules linear_fc2")


MEGATRON_FSDP = "--use-megatron-fsdp --train-iters 3 --lr-decay-iters 3"
OFFLOAD = "--fine-grained-activation-offloading --offload-modules core_attn attn_proj --min-offloaded-tensor-size 0"


def _megatron_fsdp_losses_and_counts(workdir):
    import pretrain_gpt
    from megatron.core.transformer.transformer_block import TransformerBlock
    from tests.unit_tests.dist_checkpointing.pretrain_helpers import run_pretrain

    blocks = []

    def forward_step(data_iterator, model):
        blocks.extend(module for module in model.modules() if isinstance(module, TransformerBlock))
        return pretrain_gpt.forward_step(data_iterator, model)

    plain = run_pretrain(workdir, MEGATRON_FSDP)
    offloaded = run_pretrain(workdir, f"{MEGATRON_FSDP} {OFFLOAD}", forward_step)
    offloader = blocks[0].activation_offloader
    return plain, offloaded, dict(offloader.packed), dict(offloader.unpacked)


@pytest.mark.world_size(2)
def test_megatron_fsdp_trains_the_same_losses(tmp_path):
    for plain, offloaded, packed, unpacked in run_on_ranks(2, _megatron_fsdp_losses_and_counts, str(tmp_path)):
        assert sorted(plain) == [1, 2, 3] and offloaded == plain  # exact
        assert sorted(packed) == [(layer, piece) for layer in range(1, 5) for piece in ("attn_proj", "core_attn")]
        assert packed == unpacked
        # 3 iterations x 2 microbatches per rank: attn_proj's input once per forward (its weight stays).
        assert all(packed[layer, "attn_proj"] == 3 * 2 for layer in range(1, 5))
