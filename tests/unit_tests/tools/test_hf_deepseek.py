"""tools/checkpoint --from hf / --to hf with DeepseekV3ForCausalLM: multi-latent attention (a query latent, YaRN
with mscale, interleaved rope channels), a dense first layer, then MoE layers with two shared experts and a sigmoid
router with expert bias, group-limited choice (4 groups, 2 chosen) and scaled probabilities.

The model is a tiny one transformers builds (random weights, random expert biases) in TINY_GPT's shape (4 layers,
hidden 32, 4 heads, 121 tokens), with a multi-token prediction layer added as DeepSeek's hub files hold it
(`model.layers.4.*`, which transformers ignores). Our model, built from the flags the import prints and loaded from
the converted checkpoint, computes transformers' logits; written back, the directory holds the same tensors and
config.
"""

import json
import os

import pytest
import torch

from tests.unit_tests.multiprocess_harness import run_on_ranks
from tests.unit_tests.tools.hf_conversion_helpers import (
    assert_exports_back_bit_for_bit,
    assert_logits_close,
    hf_tensors,
    import_hf,
    load_import_and_forward,
    read_config,
    train_save_and_forward,
)

VOCAB, PADDED_VOCAB, SEQUENCE = 121, 128, 16  # TINY_GPT: NullTokenizer --vocab-size 120, divisible by 64
CONFIG = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, moe_intermediate_size=12, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2, n_routed_experts=8,
              routed_scaling_factor=2.5, kv_lora_rank=8, q_lora_rank=12, qk_rope_head_dim=4, v_head_dim=8,
              qk_nope_head_dim=6, n_group=4, topk_group=2, num_experts_per_tok=4, first_k_dense_replace=1,
              max_position_embeddings=SEQUENCE, rms_norm_eps=1e-6, tie_word_embeddings=False,
              rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 0.8,
                               "mscale_all_dim": 1.0, "original_max_position_embeddings": 4, "beta_fast": 32,
                               "beta_slow": 1})
FLAGS = ("--multi-latent-attention --q-lora-rank 12 --kv-lora-rank 8 --qk-head-dim 6 --qk-pos-emb-head-dim 4 "
         "--v-head-dim 8 --rotary-scaling-factor 4 --mscale 0.8 --mscale-all-dim 1 --original-max-position-embeddings "
         "4 --moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-num-groups 4 "
         "--moe-router-group-topk 2 --moe-router-topk-scaling-factor 2.5 --mtp-num-layers 1")
LOGITS_TOLERANCE = 1e-5
MTP = "model.layers.4."


def _tokens():
    return torch.randint(0, VOCAB, (3, SEQUENCE), generator=torch.Generator().manual_seed(1234))


def _save_hf_model(directory, **overrides):
    """transformers' DeepSeek-V3 with random weights and expert biases, saved in `directory` with a multi-token
    prediction layer in the hub's layout; its logits on _tokens()."""
    import transformers
    from megatron.core.dist_checkpointing import safetensors_format

    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(**{**CONFIG, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.2 * torch.randn_like(param))
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(0.1 * torch.randn(8))
        logits = model(_tokens()).logits
    model.save_pretrained(str(directory))
    path = os.path.join(directory, "model.safetensors")
    tensors = safetensors_format.load_file(path)[0]
    generator = torch.Generator().manual_seed(5)
    for name, tensor in list(tensors.items()):  # the last layer's tensors, perturbed, as the MTP layer's
        if name.startswith("model.layers.3."):
            tensors[MTP + name[len("model.layers.3."):]] = tensor + 0.1 * torch.randn(tensor.shape, generator=generator)
    for name, shape in (("enorm.weight", (32,)), ("hnorm.weight", (32,)), ("shared_head.norm.weight", (32,)),
                        ("eh_proj.weight", (32, 64))):
        tensors[MTP + name] = 1.0 + 0.1 * torch.randn(shape, generator=generator)
    tensors[MTP + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"]
    tensors[MTP + "shared_head.head.weight"] = tensors["lm_head.weight"]
    safetensors_format.save_file(tensors, path, {"format": "pt"})
    return logits


@pytest.mark.world_size(1)
def test_deepseek_v3_computes_transformers_logits_and_round_trips(tools, tmp_path, capsys):
    import transformers

    convert_checkpoint, _ = tools
    theirs = _save_hf_model(tmp_path / "hf")
    flags = import_hf(convert_checkpoint, tmp_path / "hf", tmp_path / "ours", capsys)
    assert FLAGS in flags and "--qk-layernorm" in flags and "--disable-bias-linear" in flags, flags
    assert "--num-experts 8 --moe-ffn-hidden-size 12 --moe-router-topk 4 --moe-layer-freq [0,1,1,1]" in flags
    assert "--moe-shared-expert-intermediate-size 24" in flags and "--moe-shared-expert-gate" not in flags
    # the printed flags build the model the checkpoint records (what --use-checkpoint-args would take)
    from megatron.core.dist_checkpointing import offline
    from megatron.training.arguments import build_parser
    from megatron.training.checkpoint_args import architecture_differences

    recorded = offline.read_checkpoint(os.path.join(tmp_path, "ours", "iter_0000000"))["common"]["args"]
    assert architecture_differences(recorded, build_parser().parse_args(flags.split())) == []

    ours = run_on_ranks(1, load_import_and_forward, flags, str(tmp_path / "ours"), _tokens())[0]
    assert ours.shape == (3, SEQUENCE, PADDED_VOCAB)
    assert_logits_close(theirs, ours, "DeepSeek-V3", LOGITS_TOLERANCE)

    before, after = assert_exports_back_bit_for_bit(convert_checkpoint, tmp_path / "ours", tmp_path / "hf",
                                                    tmp_path / "back")
    assert {MTP + "eh_proj.weight", "model.layers.2.mlp.gate.e_score_correction_bias",
            "model.layers.3.mlp.experts.7.up_proj.weight", "model.layers.0.self_attn.q_b_proj.weight"} <= set(after)
    json_before, json_after = read_config(tmp_path / "hf"), read_config(tmp_path / "back")
    keys = set(json_before) - {"transformers_version"}
    assert len(keys) >= 40
    for key in keys:
        assert json_after[key] == json_before[key], (key, json_after[key], json_before[key])
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"), dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(back(_tokens()).logits, theirs)


def test_rope_interleave_false_imports_as_the_interleaved_layout_and_exports_as_it_came(tools, tmp_path):
    """HF's rotate-half rope channels (rope_interleave false) become our interleaved pairs on import (a checkpoint
    that --to hf writes for a model that was never imported is interleaved); written back, the directory says
    rope_interleave false again and holds the same tensors bit for bit, so transformers computes the same logits."""
    import transformers
    from megatron.core.dist_checkpointing import offline

    convert_checkpoint, _ = tools
    theirs = _save_hf_model(tmp_path / "hf", rope_interleave=False)
    convert_checkpoint.from_hf(str(tmp_path / "hf"), str(tmp_path / "ours"), make_vocab_size_divisible_by=64)
    ours = offline.full_precision_model(offline.read_checkpoint(os.path.join(tmp_path, "ours", "iter_0000000")))
    hf_query = hf_tensors(tmp_path / "hf")["model.layers.1.self_attn.q_b_proj.weight"]
    our_query = ours["decoder.layers.1.self_attention.linear_q_up_proj.weight"]
    rope = torch.arange(hf_query.shape[0]) % 10 >= 6  # qk_nope_head_dim 6, qk_rope_head_dim 4 per head
    assert torch.equal(our_query[~rope], hf_query[~rope]) and not torch.equal(our_query[rope], hf_query[rope])
    pairs = (-1, 2, 2, hf_query.shape[1])  # ours (i, half) is HF's (half, i): pairs 2i, 2i + 1 from i, i + 2
    assert torch.equal(our_query[rope].reshape(pairs).transpose(1, 2), hf_query[rope].reshape(pairs))
    convert_checkpoint.to_hf(str(tmp_path / "ours"), str(tmp_path / "back"))
    assert read_config(tmp_path / "back")["rope_interleave"] is False
    before, after = hf_tensors(tmp_path / "hf"), hf_tensors(tmp_path / "back")
    assert sorted(after) == sorted(before)
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"), dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(back(_tokens()).logits, theirs)


def _write_config(directory, **overrides):
    os.makedirs(directory)
    config = {**CONFIG, "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", **overrides}
    with open(os.path.join(directory, "config.json"), "w") as stream:
        json.dump(config, stream)
    return str(directory)


def test_deepseek_configs_we_cannot_compute_are_refused_naming_the_key(tools, tmp_path):
    convert_checkpoint, _ = tools
    yarn = CONFIG["rope_parameters"]
    refusals = {
        "scoring_func 'softmax': HF's DeepSeek-V3 router takes a sigmoid": dict(scoring_func="softmax"),
        "norm_topk_prob False with num_experts_per_tok 4: our sigmoid router renormalises": dict(norm_topk_prob=False),
        "n_group 4 with topk_group 1 and num_experts_per_tok 4: HF scores each group by its best two": dict(
            topk_group=1),
        "n_shared_experts 0: our DeepSeek-V3 layers have at least one shared expert": dict(n_shared_experts=0),
        "attention_bias true: our latent attention's projections have no biases": dict(attention_bias=True),
        "rms_norm_eps 1e-05: HF's latent norms use 1e-06": dict(rms_norm_eps=1e-5),
        "first_k_dense_replace 4 leaves no layer with experts among 4": dict(first_k_dense_replace=4),
        "yarn RoPE scaling with beta_fast 16: our YaRN fixes beta_fast 32": dict(
            rope_parameters={**yarn, "beta_fast": 16}),
        "yarn RoPE scaling scales cos and sin by 1.5": dict(rope_parameters={**yarn, "attention_factor": 1.5}),
        "RoPE scaling 'dynamic'": dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}),
    }
    for index, (message, overrides) in enumerate(refusals.items()):
        directory = _write_config(tmp_path / str(index), **overrides)
        with pytest.raises(SystemExit, match=message):
            convert_checkpoint.from_hf(directory, str(tmp_path / "unused"))
    assert not os.path.exists(tmp_path / "unused")
    # hidden_act 'swish' is transformers' other name of silu
    config = {**CONFIG, "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"}
    _, hf_mapping = tools
    assert hf_mapping.shape_from_hf_config({**config, "hidden_act": "swish"}, "DIR", None, PADDED_VOCAB, False) == \
        hf_mapping.shape_from_hf_config(config, "DIR", None, PADDED_VOCAB, False)


def _deepseek_shape(hf_mapping, **flags):
    values = dict(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=4, kv_channels=8,
                  ffn_hidden_size=40, vocab_size=VOCAB, padded_vocab_size=PADDED_VOCAB, max_position_embeddings=16,
                  position_embedding_type="rope", normalization="RMSNorm", norm_epsilon=1e-6, swiglu=True,
                  add_bias_linear=False, qk_layernorm=True, num_experts=8, moe_ffn_hidden_size=12, moe_router_topk=4,
                  moe_layer_freq=[0, 1, 1, 1], moe_shared_expert_intermediate_size=24,
                  moe_router_score_function="sigmoid", multi_latent_attention=True, kv_lora_rank=8, qk_head_dim=6,
                  qk_pos_emb_head_dim=4, v_head_dim=8, rotary_scaling_factor=4.0, mscale=0.0, mscale_all_dim=1.0)
    return hf_mapping.ModelShape(**{**values, **flags})


def test_our_flags_pick_deepseek_v3_and_refuse_what_it_cannot_compute(tools):
    _, hf_mapping = tools
    shape = _deepseek_shape(hf_mapping)
    assert hf_mapping.architecture_for(shape) == "DeepseekV3ForCausalLM"
    config = hf_mapping.hf_config(shape, "DeepseekV3ForCausalLM")
    assert (config["first_k_dense_replace"], config["n_shared_experts"], config["n_group"], config["topk_group"],
            config["routed_scaling_factor"], config["q_lora_rank"], config["num_nextn_predict_layers"]) == \
        (1, 2, 1, 1, 1.0, None, 0)
    # transformers would infer 1 + 0.1 ln 4 from mscale 0; ours scales cos and sin by 1 / ms(4, 1)
    rope = config["rope_parameters"]
    assert rope["attention_factor"] == pytest.approx(1 / (1 + 0.1 * torch.log(torch.tensor(4.0)).item()))
    assert "--rope-type rope" in _deepseek_shape(hf_mapping, rope_type="rope", rotary_scaling_factor=1.0,
                                                 mscale=1.0, mscale_all_dim=0.0).training_flags()
    refusals = {
        "--moe-router-score-function softmax: DeepSeek-V3's router scores experts by a sigmoid": dict(
            moe_router_score_function="softmax"),
        "no --qk-layernorm: DeepSeek-V3 normalises its latents": dict(qk_layernorm=False),
        "--moe-shared-expert-gate: DeepSeek-V3's shared experts are not gated": dict(moe_shared_expert_gate=True),
        "--moe-shared-expert-intermediate-size 20: DeepSeek-V3 has n_shared_experts >= 1 shared experts of "
        "--moe-ffn-hidden-size 12": dict(moe_shared_expert_intermediate_size=20),
        r"--moe-layer-freq \[1, 0, 1, 1\]: DeepSeek-V3 has first_k_dense_replace dense layers": dict(
            moe_layer_freq=[1, 0, 1, 1]),
        "--moe-router-topk 4 with --moe-router-group-topk 4: HF scores each group by its best two": dict(
            moe_router_num_groups=8, moe_router_group_topk=4),
        "--mtp-num-layers 2: the hub layout holds DeepSeek-V3's one multi-token prediction layer": dict(
            mtp_num_layers=2),
        "--norm-epsilon 1e-05: HF's DeepSeek-V3 fixes its latent norms' epsilon": dict(norm_epsilon=1e-5),
    }
    for message, flags in refusals.items():
        with pytest.raises(hf_mapping.ConversionError, match=message):
            hf_mapping.architecture_for(_deepseek_shape(hf_mapping, **flags))
    with pytest.raises(hf_mapping.ConversionError, match="--multi-latent-attention: only DeepseekV3ForCausalLM has"):
        hf_mapping.architecture_for(shape, hf_mapping.MIXTRAL)
    with pytest.raises(hf_mapping.ConversionError, match="no --multi-latent-attention: DeepseekV3ForCausalLM's"):
        hf_mapping.architecture_for(_deepseek_shape(hf_mapping, multi_latent_attention=False),
                                    "DeepseekV3ForCausalLM")


def _train_save_and_forward(flags, root):
    """On one rank: TINY_GPT + `flags` after one step, its weights and expert biases perturbed, saved in `root`; its
    logits."""
    from tests.unit_tests.dist_checkpointing.pretrain_helpers import TrainingState

    def perturb_expert_biases(model, generator):
        for name, buffer in model.named_buffers():
            if name.endswith("router.expert_bias"):
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=generator))

    return train_save_and_forward(TrainingState(f"{flags} --ckpt-format torch_dist"), root, _tokens(), 0.2,
                                  perturb_expert_biases)


@pytest.mark.world_size(1)
def test_trained_deepseek_checkpoint_exports_and_imports_back_bit_for_bit(tools, tmp_path):
    """A checkpoint training wrote (YaRN by default, no --original-max-position-embeddings, an MTP layer) exports
    as DeepseekV3ForCausalLM, transformers computes its logits, and --from hf gives every model tensor back."""
    import transformers
    from megatron.core.dist_checkpointing import offline

    convert_checkpoint, _ = tools
    flags = ("--position-embedding-type rope --normalization RMSNorm --norm-epsilon 1e-6 --qk-layernorm "
             "--disable-bias-linear --multi-latent-attention --kv-lora-rank 8 --qk-head-dim 6 --qk-pos-emb-head-dim 4 "
             "--v-head-dim 8 --rotary-scaling-factor 2 --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 12 "
             "--moe-shared-expert-intermediate-size 12 --moe-layer-freq ([0]*2+[1]*2) --moe-router-score-function "
             "sigmoid --moe-router-enable-expert-bias --mtp-num-layers 1")
    ours = run_on_ranks(1, _train_save_and_forward, flags, str(tmp_path / "ours"))[0]
    convert_checkpoint.to_hf(str(tmp_path / "ours"), str(tmp_path / "hf"))
    config = read_config(tmp_path / "hf")
    assert (config["first_k_dense_replace"], config["q_lora_rank"], config["num_nextn_predict_layers"],
            config["rope_parameters"]["original_max_position_embeddings"]) == (2, None, 1, 4096)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = model(_tokens()).logits
    assert_logits_close(theirs, ours, "trained DeepSeek-V3 style", LOGITS_TOLERANCE)

    convert_checkpoint.from_hf(str(tmp_path / "hf"), str(tmp_path / "back"))
    saved = offline.full_precision_model(offline.read_checkpoint(os.path.join(tmp_path, "ours", "iter_0000001")))
    back = offline.full_precision_model(offline.read_checkpoint(os.path.join(tmp_path, "back", "iter_0000001")))
    assert set(back) == set(saved) and "mtp.layers.0.transformer_layer.mlp.router.expert_bias" in back
    for name, tensor in saved.items():
        assert torch.equal(back[name], tensor), name
