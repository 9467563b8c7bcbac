"""tools/checkpoint --from hf / --to hf with Mixture-of-Experts models: Mixtral, Qwen3-MoE and Qwen2-MoE.

Each model is a tiny one that transformers builds (random weights, routers included) and saves under the Hugging
Face names (`block_sparse_moe.experts.{e}.w1`, `mlp.experts.{e}.gate_proj`, `mlp.shared_expert_gate`, ...), in
TINY_GPT's shape (4 layers, hidden 32, 4 heads, 121 tokens), with grouped-query attention, 4 experts and top-2
routing. They cover renormalised top-k probabilities (Mixtral, Qwen3-MoE with norm_topk_prob) and plain ones
(Qwen2-MoE: --moe-router-pre-softmax), dense layers between MoE layers (`decoder_sparse_step`,
`mlp_only_layers`) and Qwen2-MoE's gated shared expert. Our model, built from the flags the import prints and
loaded from the converted checkpoint, computes transformers' logits; written back, the directory holds the same
tensors and config; the checkpoint trains at EP 2 and TP 2 from the loss it has at EP 1.
"""

import json
import os

import pytest
import torch

from tests.unit_tests.multiprocess_harness import run_on_ranks
from tests.unit_tests.tools.hf_conversion_helpers import (
    assert_exports_back_bit_for_bit,
    assert_logits_close,
    import_hf,
    load_import_and_forward,
    read_config,
    train_save_and_forward,
)

VOCAB, PADDED_VOCAB, SEQUENCE = 121, 128, 16  # TINY_GPT: NullTokenizer --vocab-size 120, divisible by 64
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=SEQUENCE, rms_norm_eps=1e-6, tie_word_embeddings=False, num_experts_per_tok=2)
# name: (transformers config class, its MoE settings, the MoE flags the import gives)
MODELS = {
    # router_jitter_noise: noise in training only, written back as imported
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, intermediate_size=24, router_jitter_noise=0.1),
                "--num-experts 4 --moe-ffn-hidden-size 24 --moe-router-topk 2"),
    # layers 1 and 3 have experts; renormalised top-2
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=4, moe_intermediate_size=24, intermediate_size=40,
                                         decoder_sparse_step=2, norm_topk_prob=True),
                  "--num-experts 4 --moe-ffn-hidden-size 24 --moe-router-topk 2 --moe-layer-freq [0,1,0,1]"),
    # layer 0 dense; the top-2 probabilities as the softmax over all experts gives them; a gated shared expert
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=4, moe_intermediate_size=24, intermediate_size=40,
                                         shared_expert_intermediate_size=20, mlp_only_layers=[0], norm_topk_prob=False),
                  "--num-experts 4 --moe-ffn-hidden-size 24 --moe-router-topk 2 --moe-layer-freq [0,1,1,1] "
                  "--moe-router-pre-softmax --moe-shared-expert-intermediate-size 20 --moe-shared-expert-gate"),
}
# fp32 on CPU, as for the dense models (test_hf_export.py): HF's RMSNorm by hand, its renormalisation of the top-k
# of a softmax over all experts where ours takes the softmax of the k chosen logits.
LOGITS_TOLERANCE = 1e-5


def _tokens():
    return torch.randint(0, VOCAB, (3, SEQUENCE), generator=torch.Generator().manual_seed(1234))


def _save_hf_model(directory, name):
    """transformers' model `name` with random weights saved in `directory`; its logits on _tokens()."""
    import transformers

    config_class, moe, _ = MODELS[name]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, config_class)(**SHAPE, **moe)).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.2 * torch.randn_like(param))
        logits = model(_tokens()).logits
    model.save_pretrained(str(directory))
    return model, logits


@pytest.mark.world_size(1)
@pytest.mark.parametrize("name", list(MODELS))
def test_moe_model_computes_transformers_logits_and_round_trips(name, tools, tmp_path, capsys):
    import transformers

    convert_checkpoint, _ = tools
    original, theirs = _save_hf_model(tmp_path / "hf", name)
    flags = import_hf(convert_checkpoint, tmp_path / "hf", tmp_path / "ours", capsys)
    assert MODELS[name][2] in flags and "--swiglu" in flags and "--disable-bias-linear" in flags
    assert ("--qk-layernorm" in flags) == (name == "qwen3_moe") and ("--add-qkv-bias" in flags) == (name == "qwen2_moe")

    ours = run_on_ranks(1, load_import_and_forward, flags, str(tmp_path / "ours"), _tokens())[0]
    assert ours.shape == (3, SEQUENCE, PADDED_VOCAB)
    assert_logits_close(theirs, ours, f"{name}", LOGITS_TOLERANCE)

    before, after = assert_exports_back_bit_for_bit(convert_checkpoint, tmp_path / "ours", tmp_path / "hf",
                                                    tmp_path / "back")
    expert = ("model.layers.3.block_sparse_moe.experts.3.w3.weight" if name == "mixtral"
              else "model.layers.3.mlp.experts.3.up_proj.weight")
    assert expert in after
    # The same config, read as transformers reads it (Qwen3-MoE's num_experts is written num_local_experts).
    hf_config, back_config = (transformers.AutoConfig.from_pretrained(str(tmp_path / directory))
                              for directory in ("hf", "back"))
    json_before, json_after = (read_config(tmp_path / directory) for directory in ("hf", "back"))
    keys = set(json_before) - {"transformers_version", "sliding_window", "max_window_layers", "head_dim"}
    assert len(keys) >= 25
    for key in keys:
        assert getattr(back_config, key) == getattr(hf_config, key), key
    assert json_after["head_dim"] == (json_before.get("head_dim") or 32 // 4) == 8  # null: hidden / heads
    # sliding_window (Qwen2-MoE's config writes 0, we null) means nothing without use_sliding_window
    assert not json_after.get("use_sliding_window") and json_after["sliding_window"] is None
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"), dtype=torch.float32).eval()
    assert type(back) is type(original)
    with torch.no_grad():
        assert torch.equal(back(_tokens()).logits, theirs)


def _first_losses(workdir, flags, root):
    """The first training loss from `root` at EP 1 (DP 2), EP 2 and TP 2 (sequence parallel), on two ranks."""
    from tests.unit_tests.dist_checkpointing.pretrain_helpers import run_pretrain

    losses = {}
    for layout in ("", "--expert-model-parallel-size 2", "--tensor-model-parallel-size 2 --sequence-parallel"):
        run = run_pretrain(os.path.join(workdir, "run"), f"{flags} --load {root} --finetune --ckpt-format torch_dist "
                                                         f"--train-iters 1 {layout}")
        losses[layout or "EP 1"] = run[1]
    return losses


@pytest.mark.world_size(2)
def test_imported_moe_checkpoint_trains_at_ep2_and_tp2_from_the_same_loss(tools, tmp_path, capsys):
    """The experts are stored under their global index: EP 2 loads each rank's two, TP 2 splits every expert, and
    the first loss equals EP 1's (to the reduction order of another layout)."""
    convert_checkpoint, _ = tools
    _save_hf_model(tmp_path / "hf", "qwen2_moe")
    flags = import_hf(convert_checkpoint, tmp_path / "hf", tmp_path / "ours", capsys)
    losses = run_on_ranks(2, _first_losses, str(tmp_path), flags, str(tmp_path / "ours"))[0]
    print(losses)
    single = losses.pop("EP 1")
    assert single > 1.0
    for layout, loss in losses.items():
        assert loss == pytest.approx(single, rel=1e-5), (layout, losses, single)


def _write_config(directory, **config):
    os.makedirs(directory)
    with open(os.path.join(directory, "config.json"), "w") as stream:
        json.dump(config, stream)
    return str(directory)


def test_hf_moe_configs_we_cannot_compute_are_refused_naming_the_key(tools, tmp_path):
    convert_checkpoint, _ = tools
    base = dict(SHAPE, intermediate_size=24, num_local_experts=4, architectures=["MixtralForCausalLM"],
                model_type="mixtral")
    refusals = {
        "router_jitter_noise -0.1 must be a number >= 0": dict(router_jitter_noise=-0.1),
        "num_experts_per_tok 1: every token's one expert gets probability 1": dict(num_experts_per_tok=1),
        "num_experts_per_tok 1 with norm_topk_prob true": dict(
            architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=4, num_experts_per_tok=1,
            moe_intermediate_size=24, norm_topk_prob=True),
        r"decoder_sparse_step 2 and mlp_only_layers \[1, 3\] leave no layer with experts": dict(
            architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=4, moe_intermediate_size=24,
            decoder_sparse_step=2, mlp_only_layers=[1, 3]),
        "shared_expert_intermediate_size None must be a positive integer": dict(
            architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", num_experts=4, moe_intermediate_size=24),
        "sliding_window 8 below max_position_embeddings 16": dict(sliding_window=8),
        "Mixture-of-Experts layers other than Mixtral's.*--num-experts": dict(
            architectures=["OlmoeForCausalLM"], model_type="olmoe", num_experts=4),
    }
    for index, (message, overrides) in enumerate(refusals.items()):
        directory = _write_config(tmp_path / str(index), **{**base, **overrides})
        with pytest.raises(SystemExit, match=message):
            convert_checkpoint.from_hf(directory, str(tmp_path / "unused"))
    assert not os.path.exists(tmp_path / "unused")


def _moe_shape(hf_mapping, **flags):
    values = dict(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=8,
                  ffn_hidden_size=40, vocab_size=VOCAB, padded_vocab_size=PADDED_VOCAB, max_position_embeddings=16,
                  position_embedding_type="rope", normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                  num_experts=4, moe_ffn_hidden_size=24)
    return hf_mapping.ModelShape(**{**values, **flags})


def test_our_flags_pick_the_moe_architecture_and_refuse_what_it_cannot_compute(tools):
    _, hf_mapping = tools
    shape = _moe_shape(hf_mapping)
    assert hf_mapping.architecture_for(shape) == hf_mapping.MIXTRAL
    assert hf_mapping.architecture_for(_moe_shape(hf_mapping, qk_layernorm=True, moe_layer_freq=[0, 1, 1, 1])) == \
        hf_mapping.QWEN3_MOE
    qwen2_moe = _moe_shape(hf_mapping, moe_shared_expert_intermediate_size=16, moe_shared_expert_gate=True,
                           moe_router_pre_softmax=True, add_qkv_bias=True)
    assert hf_mapping.architecture_for(qwen2_moe) == hf_mapping.QWEN2_MOE
    config = hf_mapping.hf_config(_moe_shape(hf_mapping, qk_layernorm=True, moe_layer_freq=[0, 1, 0, 1]),
                                  hf_mapping.QWEN3_MOE)
    assert (config["decoder_sparse_step"], config["mlp_only_layers"], config["norm_topk_prob"]) == (2, [], True)
    config = hf_mapping.hf_config(qwen2_moe, hf_mapping.QWEN2_MOE)
    assert (config["decoder_sparse_step"], config["mlp_only_layers"], config["norm_topk_prob"]) == (1, [], False)
    assert (config["shared_expert_intermediate_size"], config["qkv_bias"]) == (16, True)
    refusals = {
        r"MixtralForCausalLM .*--moe-layer-freq \[0, 1, 1, 1\]: every MixtralForCausalLM layer has experts":
            (_moe_shape(hf_mapping, moe_layer_freq=[0, 1, 1, 1]), None),
        "--moe-router-pre-softmax: MixtralForCausalLM renormalises": (
            _moe_shape(hf_mapping, moe_router_pre_softmax=True), None),
        "no --moe-shared-expert-intermediate-size with --moe-shared-expert-gate: Qwen2MoeForCausalLM always": (
            _moe_shape(hf_mapping, moe_shared_expert_intermediate_size=16), None),
        "--moe-shared-expert-intermediate-size 16: Qwen3MoeForCausalLM has no shared expert": (
            _moe_shape(hf_mapping, moe_shared_expert_intermediate_size=16, qk_layernorm=True),
            hf_mapping.QWEN3_MOE),
        "--num-experts 4: LlamaForCausalLM has no experts": (shape, hf_mapping.LLAMA),
        "no --num-experts: MixtralForCausalLM's layers have experts": (
            _moe_shape(hf_mapping, num_experts=None), hf_mapping.MIXTRAL),
        "no --qk-layernorm: Qwen3MoeForCausalLM normalises": (shape, hf_mapping.QWEN3_MOE),
        "--add-qkv-bias: MixtralForCausalLM has no biases": (_moe_shape(hf_mapping, add_qkv_bias=True), None),
    }
    for message, (refused, requested) in refusals.items():
        with pytest.raises(hf_mapping.ConversionError, match=message):
            hf_mapping.architecture_for(refused, requested)


def test_refused_moe_export_says_which_conversion_keeps_the_model(tools):
    # A MoE model trained with pretrain_gpt.py's default linear biases has no Mixtral form: the refusal names the
    # flag and the formats that keep every tensor.
    _, hf_mapping = tools
    with pytest.raises(hf_mapping.ConversionError) as refused:
        hf_mapping.architecture_for(_moe_shape(hf_mapping, add_bias_linear=True))
    message = str(refused.value)
    assert "linear biases (no --disable-bias-linear): MixtralForCausalLM has no biases" in message
    assert message.endswith("converts between our own formats only (--to torch / --to safetensors)")

def test_router_options_hf_lacks_are_refused_before_export(tools):
    import argparse

    import hf_unsupported

    def refusal(**flags):
        return hf_unsupported.hf_export_refusal(argparse.Namespace(num_experts=4, **flags))

    assert refusal(moe_router_score_function="softmax", moe_router_topk_scaling_factor=1.0,
                   moe_expert_capacity_factor=-1.0, moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"],
                   moe_router_padding_for_fp8=True, moe_router_dtype="fp32") is None
    blocked = {
        "--moe-router-score-function sigmoid: a router without a softmax": dict(moe_router_score_function="sigmoid"),
        "--moe-router-enable-expert-bias: an expert bias": dict(moe_router_enable_expert_bias=True),
        "--moe-router-group-topk 2: group-limited routing": dict(moe_router_group_topk=2),
        "--moe-router-topk-scaling-factor 2.5: scaled routing probabilities": dict(
            moe_router_topk_scaling_factor=2.5),
        "--moe-expert-capacity-factor 1.0: experts that drop tokens": dict(moe_expert_capacity_factor=1.0),
        "--moe-router-load-balancing-type sinkhorn: Sinkhorn routing": dict(moe_router_load_balancing_type="sinkhorn"),
        "--moe-input-jitter-eps 0.01: jitter on the router's input alone": dict(moe_input_jitter_eps=0.01),
        "--moe-apply-probs-on-input: experts applied to the input scaled": dict(moe_apply_probs_on_input=True),
    }
    for message, flags in blocked.items():
        text = refusal(**flags)
        assert text is not None and message in text and "--to torch" in text, (message, text)
    # a dense model's MoE flags keep their defaults and block nothing
    assert hf_unsupported.hf_export_refusal(argparse.Namespace(num_experts=None, moe_router_load_balancing_type=
                                                               "aux_loss", moe_router_score_function="softmax")) is None


def _train_save_and_forward(flags, root):
    """On one rank: TINY_GPT + `flags` after one step, its weights perturbed, saved in `root`; its logits."""
    from tests.unit_tests.dist_checkpointing.pretrain_helpers import TrainingState

    return train_save_and_forward(TrainingState(f"{flags} --ckpt-format torch_dist"), root, _tokens(), 0.2)


@pytest.mark.world_size(1)
def test_trained_moe_checkpoint_exports_as_qwen3_moe(tools, tmp_path):
    """A checkpoint training wrote (its own arguments: --moe-layer-freq 2, the experts' width its own flag) exports
    as the architecture our flags pick, and transformers computes its logits."""
    import transformers

    convert_checkpoint, _ = tools
    flags = ("--normalization RMSNorm --position-embedding-type rope --disable-bias-linear --qk-layernorm "
             "--group-query-attention --num-query-groups 2 --num-experts 4 --moe-ffn-hidden-size 24 "
             "--moe-router-topk 2 --moe-layer-freq 2 --moe-router-pre-softmax --moe-aux-loss-coeff 0.01")
    ours = run_on_ranks(1, _train_save_and_forward, flags, str(tmp_path / "ours"))[0]
    convert_checkpoint.to_hf(str(tmp_path / "ours"), str(tmp_path / "hf"))
    config = read_config(tmp_path / "hf")
    # our layers 0 and 2 have experts: HF's step 1 with layers 1 and 3 dense
    assert (config["architectures"], config["decoder_sparse_step"], config["mlp_only_layers"]) == \
        (["Qwen3MoeForCausalLM"], 1, [1, 3])
    assert (config["norm_topk_prob"], config["moe_intermediate_size"], config["intermediate_size"]) == (False, 24, 64)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = model(_tokens()).logits
    assert_logits_close(theirs, ours, "trained Qwen3-MoE style", LOGITS_TOLERANCE)
