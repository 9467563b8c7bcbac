"""tools/checkpoint --from hf / --to hf with gpt-oss (GptOssForCausalLM).

The model is a tiny one that transformers builds with random weights (sinks, biases and experts included) in
TINY_GPT's shape (4 layers, hidden 32, 4 heads, 121 tokens) with grouped-query attention, 4 experts, top-2
routing and a sliding window of 4 positions on layers 0 and 2 (HF's alternation), so that the window cuts into
the 16 positions. Its router biases are random (--moe-router-bias) and its RoPE is transformers' default, YaRN
(factor 32 over 4096 original positions, base 150000, fractional correction range: with 8 channels a head the
blend covers pairs 1.01 to 2.17, so rounding them would change the frequencies). Our model, built from the flags
the import prints and loaded from the converted checkpoint, computes transformers' logits; written back, the
directory holds the same tensors and config.
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
    load_and_forward,
    read_config,
    train_save_and_forward,
    ungated_training_state,
)

VOCAB, PADDED_VOCAB, SEQUENCE = 121, 128, 16  # TINY_GPT: NullTokenizer --vocab-size 120, divisible by 64
CONFIG = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=8, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
              max_position_embeddings=SEQUENCE, sliding_window=4, tie_word_embeddings=False)
FLAGS = ("--num-experts 4 --moe-ffn-hidden-size 24 --moe-router-topk 2", "--quick-geglu --moe-router-bias",
         "--activation-func-clamp-value 7 --glu-linear-offset 1 --softmax-type learnable",
         "--window-size 3,0 --window-attn-skip-freq 2", "--position-embedding-type yarn --rotary-base 150000",
         "--yarn-rotary-scaling-factor 32.0 --no-yarn-correction-range-round-to-int")
LOGITS_TOLERANCE = 1e-5  # fp32 on CPU, as for the other families


def _tokens():
    return torch.randint(0, VOCAB, (3, SEQUENCE), generator=torch.Generator().manual_seed(1234))


def _save_hf_model(directory, **changes):
    """transformers' gpt-oss with random weights (router biases included) saved in `directory`; its logits."""
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.GptOssConfig(**{**CONFIG, **changes})).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.3 * torch.randn_like(param))
        logits = model(_tokens()).logits
    model.save_pretrained(str(directory))
    return model, logits


def _training_state(flags):
    """TINY_GPT without its --swiglu (gpt-oss's MLP is --quick-geglu) + `flags`, as pretrain() builds it."""
    return ungated_training_state(flags)


def _load_and_forward(flags, root):
    """On one rank: our model of `flags`, loaded from `root` as training loads it; its logits."""
    return load_and_forward(_training_state(f"{flags} --load {root} --finetune --ckpt-format torch_dist"), _tokens())


def _train_save_and_forward(flags, root):
    """On one rank: our model of `flags` after one step, its weights perturbed, saved in `root`; its logits."""
    return train_save_and_forward(_training_state(f"{flags} --ckpt-format torch_dist"), root, _tokens(), 0.3)


@pytest.mark.world_size(1)
def test_gpt_oss_computes_transformers_logits_and_round_trips(tools, tmp_path, capsys):
    import transformers

    convert_checkpoint, _ = tools
    original, theirs = _save_hf_model(tmp_path / "hf")
    flags = import_hf(convert_checkpoint, tmp_path / "hf", tmp_path / "ours", capsys)
    for expected in FLAGS:
        assert expected in flags, (expected, flags)
    assert "--swiglu" not in flags and "--disable-bias-linear" not in flags and "--moe-layer-freq" not in flags

    ours = run_on_ranks(1, _load_and_forward, flags, str(tmp_path / "ours"))[0]
    assert ours.shape == (3, SEQUENCE, PADDED_VOCAB)
    assert_logits_close(theirs, ours, "gpt-oss", LOGITS_TOLERANCE)

    before, after = assert_exports_back_bit_for_bit(convert_checkpoint, tmp_path / "ours", tmp_path / "hf",
                                                    tmp_path / "back")
    assert after["model.layers.3.mlp.experts.gate_up_proj"].shape == (4, 32, 48)
    assert after["model.layers.1.self_attn.sinks"].abs().min() > 0  # the learned sinks came back
    assert after["model.layers.2.mlp.router.bias"].abs().min() > 0  # and the router biases
    hf_config, back_config = (transformers.AutoConfig.from_pretrained(str(tmp_path / directory))
                              for directory in ("hf", "back"))
    keys = set(read_config(tmp_path / "hf")) - {"transformers_version"}
    assert len(keys) >= 30 and {"layer_types", "sliding_window", "swiglu_limit", "rope_parameters"} <= keys
    for key in keys:
        assert getattr(back_config, key) == getattr(hf_config, key), key
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"), dtype=torch.float32).eval()
    assert type(back) is type(original)
    with torch.no_grad():
        assert torch.equal(back(_tokens()).logits, theirs)


@pytest.mark.world_size(1)
def test_trained_gpt_oss_checkpoint_exports_and_transformers_computes_its_logits(tools, tmp_path):
    """A checkpoint training wrote (its own arguments: a window of 3 positions on layers 1 and 2 only) exports as
    GptOssForCausalLM with zero router biases, and transformers computes its logits."""
    import transformers

    convert_checkpoint, _ = tools
    flags = ("--normalization RMSNorm --position-embedding-type rope --group-query-attention --num-query-groups 2 "
             "--num-experts 4 --moe-ffn-hidden-size 24 --moe-router-topk 2 --quick-geglu "
             "--activation-func-clamp-value 7 --glu-linear-offset 1 --softmax-type learnable --window-size 2,0 "
             "--window-attn-skip-freq [0,1,1,0]")
    ours = run_on_ranks(1, _train_save_and_forward, flags, str(tmp_path / "ours"))[0]
    written = convert_checkpoint.to_hf(str(tmp_path / "ours"), str(tmp_path / "hf"))
    config = read_config(tmp_path / "hf")
    assert config["architectures"] == ["GptOssForCausalLM"] and config["sliding_window"] == 3
    assert config["layer_types"] == ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
    assert not torch.count_nonzero(written["model.layers.0.mlp.router.bias"])
    assert torch.count_nonzero(written["model.layers.0.mlp.experts.down_proj_bias"])
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = model(_tokens()).logits
    assert_logits_close(theirs, ours, "trained gpt-oss", LOGITS_TOLERANCE)


def test_gpt_oss_without_windowed_layers_exports_a_model_transformers_runs(tools, tmp_path):
    """transformers' gpt-oss builds its sliding-window mask even when every layer is full_attention: the export of
    such a model keeps the imported sliding_window (and, for one training wrote, writes GptOssConfig's 128), so
    transformers computes the same logits instead of failing on a null sliding_window."""
    import transformers

    convert_checkpoint, hf_mapping = tools
    _, theirs = _save_hf_model(tmp_path / "hf", layer_types=["full_attention"] * 4, num_hidden_layers=4)
    convert_checkpoint.from_hf(str(tmp_path / "hf"), str(tmp_path / "ours"))
    convert_checkpoint.to_hf(str(tmp_path / "ours"), str(tmp_path / "back"))
    config = read_config(tmp_path / "back")
    assert config["layer_types"] == ["full_attention"] * 4 and config["sliding_window"] == 4
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"), dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(back(_tokens()).logits, theirs)
    shape, architecture = hf_mapping.shape_from_hf_config(config, "back", None, PADDED_VOCAB, False)
    assert shape.window_size is None and hf_mapping.hf_config(shape, architecture)["sliding_window"] == 128


def test_gpt_oss_window_pattern_and_biases_read_from_config_json(tools):
    """layer_types other than HF's alternation become a 0/1 --window-attn-skip-freq, attention_bias false
    --disable-bias-linear; written back they give the same config."""
    _, hf_mapping = tools
    config = dict(CONFIG, architectures=["GptOssForCausalLM"], model_type="gpt_oss", attention_bias=False,
                  layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"])
    shape, architecture = hf_mapping.shape_from_hf_config(config, "hf", None, PADDED_VOCAB, False)
    assert architecture == "GptOssForCausalLM" and not shape.add_bias_linear
    assert shape.window_size == (3, 0) and shape.window_attn_skip_freq == [0, 1, 1, 0]
    assert "--window-attn-skip-freq [0,1,1,0]" in shape.training_flags()
    assert hf_mapping.architecture_for(shape) == "GptOssForCausalLM"
    written = hf_mapping.hf_config(shape, architecture)
    assert written["layer_types"] == config["layer_types"] and written["sliding_window"] == 4
    assert written["attention_bias"] is False and written["swiglu_limit"] == 7.0
    full = dict(config, layer_types=["full_attention"] * 4)
    shape, _ = hf_mapping.shape_from_hf_config(full, "hf", None, PADDED_VOCAB, False)
    assert shape.window_size is None and "--window-size" not in shape.training_flags()
    assert hf_mapping.hf_config(shape, "GptOssForCausalLM")["layer_types"] == ["full_attention"] * 4


def _write_config(directory, **config):
    os.makedirs(directory)
    with open(os.path.join(directory, "config.json"), "w") as stream:
        json.dump(config, stream)
    return str(directory)


def test_gpt_oss_that_we_cannot_compute_is_refused_naming_the_key(tools, tmp_path):
    convert_checkpoint, _ = tools
    base = dict(CONFIG, architectures=["GptOssForCausalLM"], model_type="gpt_oss")
    yarn = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
            "original_max_position_embeddings": 4096, "rope_theta": 150000.0}
    refusals = {
        r"'yarn' with attention_factor 2.0: our YaRN multiplies cos and sin by .* = 1.34657 \(--yarn-mscale":
            dict(rope_parameters=dict(yarn, attention_factor=2.0)),
        "'yarn' with beta_fast -1: it must be a positive number": dict(rope_parameters=dict(yarn, beta_fast=-1)),
        r"swiglu_alpha 1.5: --quick-geglu's gate is x \* sigmoid\(1.702 x\)": dict(swiglu_alpha=1.5),
        "quantization_config \\(mxfp4\\).*dequantize first with transformers.*Mxfp4Config\\(dequantize=True\\)":
            dict(quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": ["router"]}),
        "layer_types .* expected one 'sliding_attention' or 'full_attention' per layer": dict(
            layer_types=["sliding_attention"] * 3),
    }
    for index, (message, change) in enumerate(refusals.items()):
        directory = _write_config(tmp_path / str(index), **{**base, **change})
        with pytest.raises(SystemExit, match=message):
            convert_checkpoint.import_hf(directory, str(tmp_path / f"out{index}"), None, 64, False)
    # Without linear biases (attention_bias false) a router bias, which ours then lacks, is refused naming it.
    import transformers

    model = transformers.AutoModelForCausalLM.from_config(transformers.GptOssConfig(**CONFIG, attention_bias=False))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "bias" in name:
                param.zero_()
        model.model.layers[2].mlp.router.bias[1] = 0.5
    model.save_pretrained(str(tmp_path / "biased"))
    with pytest.raises(SystemExit, match="'model.layers.2.mlp.router.bias' is not zero, but .* router has no bias "
                       r"\(--moe-router-bias needs linear biases"):
        convert_checkpoint.import_hf(str(tmp_path / "biased"), str(tmp_path / "out"), None, 64, False)


def test_gpt_oss_export_names_the_flags_it_lacks(tools):
    import argparse

    import hf_unsupported

    _, hf_mapping = tools
    gpt_oss = dict(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=8,
                   ffn_hidden_size=24, vocab_size=VOCAB, padded_vocab_size=PADDED_VOCAB, max_position_embeddings=16,
                   position_embedding_type="rope", normalization="RMSNorm", quick_geglu=True,
                   activation_func_clamp_value=7.0, glu_linear_offset=1.0, softmax_type="learnable",
                   window_size=(3, 0), window_attn_skip_freq=2, num_experts=4, moe_ffn_hidden_size=24)
    assert hf_mapping.architecture_for(hf_mapping.ModelShape(**gpt_oss)) == "GptOssForCausalLM"
    problems = {"--softmax-type off-by-one: gpt-oss's attention has a learned sink per head":
                dict(softmax_type="off-by-one"),
                "no --activation-func-clamp-value: gpt-oss clamps": dict(activation_func_clamp_value=None),
                "--glu-linear-offset 0.0: gpt-oss multiplies by up \\+ 1": dict(glu_linear_offset=0.0),
                "--window-size \\(-1, 0\\): gpt-oss's window looks back a fixed number": dict(window_size=(-1, 0)),
                "--moe-router-pre-softmax: gpt-oss's router": dict(moe_router_pre_softmax=True),
                "--moe-layer-freq \\[0, 1, 1, 1\\]: every gpt-oss layer has experts": dict(moe_layer_freq=[0, 1, 1, 1])}
    for message, change in problems.items():
        with pytest.raises(hf_mapping.ConversionError, match=f"GptOssForCausalLM .*{message}"):
            hf_mapping.architecture_for(hf_mapping.ModelShape(**{**gpt_oss, **change}))
    # asked for as another architecture, each gpt-oss feature is named
    with pytest.raises(hf_mapping.ConversionError, match="--quick-geglu: MixtralForCausalLM's MLP.*--softmax-type "
                       "learnable: MixtralForCausalLM's attention has no sinks.*--window-size \\(3, 0\\)"):
        hf_mapping.architecture_for(hf_mapping.ModelShape(**gpt_oss), "MixtralForCausalLM")
    # the early refusal lets a model that may be gpt-oss through, and still refuses the flags elsewhere
    flags = dict(quick_geglu=True, activation_func_clamp_value=7.0, glu_linear_offset=1.0, softmax_type="learnable",
                 window_size=(3, 0))
    assert hf_unsupported.hf_export_refusal(argparse.Namespace(**flags, num_experts=4)) is None
    refusal = hf_unsupported.hf_export_refusal(argparse.Namespace(**flags, num_experts=None))
    assert "--softmax-type learnable: attention sinks" in refusal and "--window-size (3, 0)" in refusal
