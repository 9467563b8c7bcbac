"""tools/checkpoint --from hf / --to hf with YaRN RoPE scaling on dense Llama-family models (hf_rope.py).

Each model is a tiny one that transformers builds with random weights (2 layers, hidden 32, grouped-query
attention) whose RoPE is YaRN over 8 original positions scaled by 4 to 32, so that most channel pairs of a head
are interpolated over the 16 positions: a Llama with every YaRN key set off its default (beta_fast / beta_slow,
mscale over mscale_all_dim as the cos / sin factor, a fractional correction range) and a Qwen2 whose config.json
says what Qwen2.5's long-context ones do (`rope_scaling: {"type": "yarn", "factor": 4.0,
"original_max_position_embeddings": ...}`, the factor 0.1 ln(4) + 1 transformers derives). Our model, built from
the flags the import prints and loaded from the converted checkpoint, computes transformers' logits; written back,
transformers computes the same logits from the directory.
"""

import json

import pytest
import torch

from tests.unit_tests.multiprocess_harness import run_on_ranks
from tests.unit_tests.tools.hf_conversion_helpers import (
    assert_logits_close,
    import_hf,
    load_import_and_forward,
    read_config,
)

VOCAB, PADDED_VOCAB, SEQUENCE = 121, 128, 16  # TINY_GPT: NullTokenizer --vocab-size 120, divisible by 64
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=32, rms_norm_eps=1e-6,
             tie_word_embeddings=False)
LLAMA_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8,
              "beta_fast": 8.0, "beta_slow": 2.0, "mscale": 0.9, "mscale_all_dim": 0.5, "truncate": False}
QWEN25_YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}
# name: (transformers config class, config.json's RoPE keys, the flags the import gives)
MODELS = {
    "llama": ("LlamaConfig", {"rope_parameters": LLAMA_YARN},
              "--position-embedding-type yarn --rotary-base 10000 --yarn-rotary-scaling-factor 4.0 "
              "--yarn-original-max-position-embeddings 8 --yarn-beta-fast 8.0 --yarn-beta-slow 2.0 "
              "--yarn-mscale 0.9 --yarn-mscale-all-dim 0.5 --no-yarn-correction-range-round-to-int"),
    "qwen2": ("Qwen2Config", {"rope_scaling": QWEN25_YARN, "rope_theta": 1e6},
              "--position-embedding-type yarn --rotary-base 1000000 --yarn-rotary-scaling-factor 4.0 "
              "--yarn-original-max-position-embeddings 8 --normalization"),
}
LOGITS_TOLERANCE = 1e-5  # fp32 on CPU, as for the other families


def _tokens():
    return torch.randint(0, VOCAB, (3, SEQUENCE), generator=torch.Generator().manual_seed(1234))


def _save_hf_model(directory, name):
    """transformers' model `name` with random weights saved in `directory` with config.json's RoPE keys as
    MODELS gives them; its logits on _tokens()."""
    import transformers

    config_class, rope, _ = MODELS[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**SHAPE, **rope)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.2 * torch.randn_like(param))
        logits = model(_tokens()).logits
    model.save_pretrained(str(directory))
    written = read_config(directory)
    for key in ("rope_parameters", "rope_scaling", "rope_theta"):
        written.pop(key, None)
    with open(directory / "config.json", "w") as stream:
        json.dump({**written, **rope}, stream)
    return model, logits


@pytest.mark.world_size(1)
@pytest.mark.parametrize("name", list(MODELS))
def test_yarn_model_computes_transformers_logits_and_exports_its_rope(name, tools, tmp_path, capsys):
    import transformers

    convert_checkpoint, _ = tools
    original, theirs = _save_hf_model(tmp_path / "hf", name)
    flags = import_hf(convert_checkpoint, tmp_path / "hf", tmp_path / "ours", capsys)
    assert MODELS[name][2] in flags, flags

    ours = run_on_ranks(1, load_import_and_forward, flags, str(tmp_path / "ours"), _tokens())[0]
    assert ours.shape == (3, SEQUENCE, PADDED_VOCAB)
    assert_logits_close(theirs, ours, name, LOGITS_TOLERANCE)

    convert_checkpoint.to_hf(str(tmp_path / "ours"), str(tmp_path / "back"))
    rope = read_config(tmp_path / "back")["rope_parameters"]
    expected = {**LLAMA_YARN} if name == "llama" else {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                                       "original_max_position_embeddings": 8}
    assert {key: rope[key] for key in expected} == expected
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"), dtype=torch.float32).eval()
    assert type(back) is type(original)
    with torch.no_grad():
        assert torch.equal(back(_tokens()).logits, theirs)


def test_yarn_keys_our_model_cannot_compute_are_refused_naming_them(tools):
    """A YaRN attention_factor other than the one our --yarn-mscale / --yarn-mscale-all-dim give, a partial
    rotation, and a non-positive beta are refused, naming the key."""
    _, hf_mapping = tools
    config = dict(SHAPE, architectures=["Qwen2ForCausalLM"], model_type="qwen2", rope_theta=1e6)
    refusals = {
        r"RoPE scaling 'yarn' with attention_factor 2.0: our YaRN multiplies cos and sin by .* = 1.13863 ":
            {"rope_scaling": {**QWEN25_YARN, "attention_factor": 2.0}},
        "partial_rotary_factor 0.5: Llama rotates whole heads": {"rope_scaling": QWEN25_YARN,
                                                                 "partial_rotary_factor": 0.5},
        "RoPE scaling 'yarn' with beta_slow -1: it must be a positive number":
            {"rope_scaling": {**QWEN25_YARN, "beta_slow": -1}},
    }
    for message, change in refusals.items():
        with pytest.raises(hf_mapping.ConversionError, match=f"^DIR: {message}"):
            hf_mapping.shape_from_hf_config({**config, **change}, "DIR", None, 128, False)
    # transformers prefers a top-level original_max_position_embeddings to the one in rope_scaling
    shape = hf_mapping.shape_from_hf_config({**config, "rope_scaling": QWEN25_YARN,
                                             "original_max_position_embeddings": 16}, "DIR", None, 128, False)[0]
    assert (shape.position_embedding_type, shape.yarn_original_max_position_embeddings) == ("yarn", 16)


def test_trained_yarn_checkpoint_exports_as_llama_with_its_yarn_config(tools):
    """Arguments a run trained with (--position-embedding-type yarn, no import recorded) pick LlamaForCausalLM,
    whose config.json holds the YaRN keys; --use-rope-scaling with it, a second RoPE scaling, is refused."""
    _, hf_mapping = tools
    values = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=8,
                  ffn_hidden_size=48, vocab_size=VOCAB, padded_vocab_size=PADDED_VOCAB, max_position_embeddings=32,
                  normalization="RMSNorm", swiglu=True, add_bias_linear=False, position_embedding_type="yarn",
                  rotary_base=500000, yarn_rotary_scaling_factor=8.0, yarn_original_max_position_embeddings=8,
                  yarn_mscale=0.707, yarn_mscale_all_dim=0.707)
    shape = hf_mapping.ModelShape(**values)
    assert hf_mapping.architecture_for(shape) == hf_mapping.LLAMA
    config = hf_mapping.hf_config(shape, hf_mapping.LLAMA)
    assert config["rope_parameters"] == {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                         "truncate": True, "original_max_position_embeddings": 8,
                                         "mscale": 0.707, "mscale_all_dim": 0.707, "rope_theta": 500000.0}
    assert hf_mapping.shape_from_hf_config(config, "DIR", None, PADDED_VOCAB, False) == (shape, hf_mapping.LLAMA)
    with pytest.raises(hf_mapping.ConversionError, match=r"LlamaForCausalLM \(the architecture for rotary positions "
                       r"\(--position-embedding-type yarn\)\) .*--use-rope-scaling / --rotary-seq-len-interpolation"):
        hf_mapping.architecture_for(hf_mapping.ModelShape(**values, use_rope_scaling=True))
