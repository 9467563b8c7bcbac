"""tools/checkpoint --from hf / --to hf with Llama-Nemotron's DeciLMForCausalLM (`nemotron-nas`): layers of their own
shapes from `block_configs`.

transformers has no DeciLM class (the hub's models bring their own code), so the test writes a tiny DeciLM directory
itself (config.json as the hub's, random fp32 weights in model.safetensors) and assembles the reference from
transformers' Llama modules, DeciLM's decoder layer put together by hand: LlamaAttention with the layer's
key/value heads, LlamaMLP with the layer's width, LlamaRMSNorm, LlamaRotaryEmbedding (llama3 RoPE scaling, which
changes the two slowest of the four frequencies of 8-channel heads) and plain linears for the replacements. Our
model, built from the flags the import prints and loaded from the converted checkpoint, computes its logits;
written back, the directory holds the same tensors and config.
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
HIDDEN, HEADS = 32, 4


def _attention(heads_in_group=None, no_op=False, linear=False):
    return {"n_heads_in_group": heads_in_group, "no_op": no_op, "replace_with_linear": linear, "sparsify": None,
            "window_length": None, "num_sink_tokens": None, "unshifted_sink": False,
            "use_prefill_window_in_sink_attention": False}


def _ffn(ffn_mult=None, no_op=False, linear=False):
    return {"ffn_mult": ffn_mult, "no_op": no_op, "replace_with_linear": linear, "sparsify": None}


# Grouped-query attention with 2 groups and with 1, a dropped attention, its linear replacement, full attention;
# MLP widths 256 and 512 (ffn_mult 2.0 and 13.0 at hidden 32), a dropped MLP and its linear replacement.
BLOCK_CONFIGS = [
    {"attention": _attention(heads_in_group=2), "ffn": _ffn(ffn_mult=2.0)},
    {"attention": _attention(heads_in_group=4), "ffn": _ffn(ffn_mult=13.0)},
    {"attention": _attention(no_op=True), "ffn": _ffn(ffn_mult=2.0)},
    {"attention": _attention(linear=True), "ffn": _ffn(no_op=True)},
    {"attention": _attention(heads_in_group=1), "ffn": _ffn(linear=True)},
]
ROPE_SCALING = {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                "original_max_position_embeddings": 8192, "rope_type": "llama3"}
# As Llama-3.3-Nemotron-Super-49B-v1's config.json, shrunk.
CONFIG = {
    "architectures": ["DeciLMForCausalLM"], "model_type": "nemotron-nas", "attention_bias": False,
    "attention_dropout": 0.0, "auto_map": {"AutoConfig": "configuration_decilm.DeciLMConfig",
                                           "AutoModelForCausalLM": "modeling_decilm.DeciLMForCausalLM"},
    "block_configs": BLOCK_CONFIGS, "bos_token_id": 1, "eos_token_id": [2, 3], "hidden_act": "silu",
    "hidden_size": HIDDEN, "initializer_range": 0.02, "intermediate_size": None, "max_position_embeddings": SEQUENCE,
    "mlp_bias": False, "num_attention_heads": HEADS, "num_hidden_layers": len(BLOCK_CONFIGS),
    "num_key_value_heads": None, "pretraining_tp": 1, "rms_norm_eps": 1e-5, "rope_scaling": ROPE_SCALING,
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "float32", "transformers_version": "4.48.3",
    "use_cache": True, "vocab_size": VOCAB}
IMPORTED_FLAGS = ("--num-layers 5 --hidden-size 32 --ffn-hidden-size 512 --num-attention-heads 4 "
                  "--max-position-embeddings 16 --position-embedding-type rope --rotary-base 500000 "
                  "--use-rope-scaling --rope-scaling-factor 8 --normalization RMSNorm --norm-epsilon 1e-05 --swiglu "
                  "--untie-embeddings-and-output-weights --disable-bias-linear --hidden-dropout 0 "
                  "--attention-dropout 0 --heterogeneous-layers-config-path ")
# fp32 on CPU, relative to the largest logit: the same sums, some in another order (fused QKV, SwiGLU rows).
LOGITS_TOLERANCE = 1e-5


def _intermediate_size(ffn_mult):
    """DeciLM's MLP width: 2/3 of ffn_mult x hidden, truncated, then up to a multiple of 256."""
    width = int(2 * ffn_mult * HIDDEN / 3)
    return width + (-width) % 256


def _llama_config(**changes):
    import transformers

    # max_position_embeddings above llama3's original 8192, as transformers expects (llama3 RoPE does not read it)
    values = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                  intermediate_size=256, max_position_embeddings=16384, rms_norm_eps=CONFIG["rms_norm_eps"],
                  rope_parameters={**ROPE_SCALING, "rope_theta": CONFIG["rope_theta"]})
    config = transformers.LlamaConfig(**{**values, **changes})
    config._attn_implementation = "eager"
    return config


class _Reference(torch.nn.Module):
    """DeciLM's model of `block_configs` from transformers' Llama modules, its parameters under DeciLM's names."""

    def __init__(self, block_configs):
        from transformers.models.llama import modeling_llama as llama

        super().__init__()
        self.block_configs = block_configs
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(VOCAB, HIDDEN)
        self.model.layers = torch.nn.ModuleList()
        for index, block in enumerate(block_configs):
            layer = torch.nn.Module()
            attention, ffn = block["attention"], block["ffn"]
            if not attention["no_op"]:
                layer.input_layernorm = llama.LlamaRMSNorm(HIDDEN, eps=CONFIG["rms_norm_eps"])
                if attention["replace_with_linear"]:
                    layer.self_attn = torch.nn.Module()
                    layer.self_attn.linear_attn = torch.nn.Linear(HIDDEN, HIDDEN, bias=False)
                else:
                    heads = _llama_config(num_key_value_heads=HEADS // attention["n_heads_in_group"])
                    layer.self_attn = llama.LlamaAttention(heads, index)
            if not ffn["no_op"]:
                layer.post_attention_layernorm = llama.LlamaRMSNorm(HIDDEN, eps=CONFIG["rms_norm_eps"])
                if ffn["replace_with_linear"]:
                    layer.mlp = torch.nn.Module()
                    layer.mlp.linear_mlp = torch.nn.Linear(HIDDEN, HIDDEN, bias=False)
                else:
                    layer.mlp = llama.LlamaMLP(_llama_config(intermediate_size=_intermediate_size(ffn["ffn_mult"])))
            self.model.layers.append(layer)
        self.model.norm = llama.LlamaRMSNorm(HIDDEN, eps=CONFIG["rms_norm_eps"])
        self.lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
        self.rotary = llama.LlamaRotaryEmbedding(_llama_config())

    def forward(self, tokens):
        hidden = self.model.embed_tokens(tokens)
        positions = torch.arange(tokens.shape[1]).expand_as(tokens)
        rotary = self.rotary(hidden, positions)
        causal = torch.full((tokens.shape[1],) * 2, torch.finfo(torch.float32).min).triu(1)[None, None]
        for layer, block in zip(self.model.layers, self.block_configs):
            if not block["attention"]["no_op"]:
                normed = layer.input_layernorm(hidden)
                if block["attention"]["replace_with_linear"]:
                    hidden = hidden + layer.self_attn.linear_attn(normed)
                else:
                    hidden = hidden + layer.self_attn(normed, rotary, causal)[0]
            if not block["ffn"]["no_op"]:
                normed = layer.post_attention_layernorm(hidden)
                hidden = hidden + (layer.mlp.linear_mlp(normed) if block["ffn"]["replace_with_linear"]
                                   else layer.mlp(normed))
        return self.lm_head(self.model.norm(hidden))


def _tokens():
    return torch.randint(0, VOCAB, (2, SEQUENCE), generator=torch.Generator().manual_seed(1234))


def _reference_logits(tensors):
    reference = _Reference(BLOCK_CONFIGS).eval()
    if "lm_head.weight" not in tensors:  # tie_word_embeddings
        tensors = {**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"]}
    reference.load_state_dict(tensors, strict=True)  # every tensor, under exactly DeciLM's names
    with torch.no_grad():
        return reference(_tokens())


def _save_hf_model(directory):
    """A DeciLM directory of CONFIG with random weights (norms 1 + 0.1 x N(0, 1), the rest 0.2 x N(0, 1));
    its tensors."""
    from megatron.core.dist_checkpointing import safetensors_format

    generator = torch.Generator().manual_seed(0)
    names = _Reference(BLOCK_CONFIGS).state_dict()
    tensors = {name: (1.0 if name.endswith("norm.weight") else 0.0) + (0.1 if name.endswith("norm.weight") else 0.2)
               * torch.randn(tensor.shape, generator=generator) for name, tensor in names.items()}
    os.makedirs(directory)
    with open(os.path.join(directory, "config.json"), "w") as stream:
        json.dump(CONFIG, stream, indent=2)
    safetensors_format.save_file(tensors, os.path.join(directory, "model.safetensors"), {"format": "pt"})
    return tensors


@pytest.mark.world_size(1)
def test_decilm_computes_the_reference_logits_and_round_trips(tools, tmp_path, capsys):
    from megatron.core.dist_checkpointing import offline
    from megatron.training.arguments import build_parser
    from megatron.training.checkpoint_args import apply_checkpoint_args

    convert_checkpoint, _ = tools
    tensors = _save_hf_model(tmp_path / "hf")
    assert tensors["model.layers.1.self_attn.k_proj.weight"].shape == (8, HIDDEN)  # one key/value head
    assert tensors["model.layers.1.mlp.gate_proj.weight"].shape == (512, HIDDEN)
    theirs = _reference_logits(tensors)
    flags = import_hf(convert_checkpoint, tmp_path / "hf", tmp_path / "ours", capsys)
    assert flags.startswith(IMPORTED_FLAGS + str(tmp_path / "hf" / "config.json")), flags

    recorded = offline.read_checkpoint(os.path.join(tmp_path, "ours", "iter_0000000"))["common"]["args"]
    with open(tmp_path / "hf" / "config.json") as stream:
        assert recorded.heterogeneous_layers_config_encoded_json == stream.read()
    run = build_parser().parse_args(["--use-checkpoint-args"])  # the layers come with the checkpoint's arguments
    apply_checkpoint_args(run, recorded)
    assert run.heterogeneous_layers_config_encoded_json == recorded.heterogeneous_layers_config_encoded_json

    ours = run_on_ranks(1, load_import_and_forward, flags, str(tmp_path / "ours"), _tokens())[0]
    assert ours.shape == (2, SEQUENCE, PADDED_VOCAB)
    assert_logits_close(theirs, ours, "DeciLM", LOGITS_TOLERANCE * theirs.abs().max().item())

    before, _ = assert_exports_back_bit_for_bit(convert_checkpoint, tmp_path / "ours", tmp_path / "hf",
                                                tmp_path / "back")
    assert {"model.layers.3.self_attn.linear_attn.weight", "model.layers.4.mlp.linear_mlp.weight"} <= set(before)
    assert not any(name.startswith(("model.layers.2.input_layernorm", "model.layers.2.self_attn",
                                    "model.layers.3.post_attention_layernorm", "model.layers.3.mlp"))
                   for name in before)
    back = read_config(tmp_path / "back")
    assert back["block_configs"] == BLOCK_CONFIGS
    assert (back["architectures"], back["model_type"]) == (["DeciLMForCausalLM"], "nemotron-nas")
    for key in set(CONFIG) - {"transformers_version"}:
        assert back.get(key, "MISSING") == CONFIG[key], (key, back.get(key, "MISSING"), CONFIG[key])


def _with_config(**changes):
    config = json.loads(json.dumps(CONFIG))
    config.update(changes)
    return config


def test_what_decilm_computes_otherwise_is_refused_by_key(tools):
    _, hf_mapping = tools
    blocks = json.loads(json.dumps(BLOCK_CONFIGS))
    blocks[1]["attention"]["window_length"] = 8
    for config, message in (
            (_with_config(attention_bias=True, mlp_bias=True), "attention_bias true: .*; mlp_bias true: "),
            (_with_config(hidden_act="gelu"), "hidden_act 'gelu'"),
            (_with_config(head_dim=16), "head_dim 16: DeciLM's heads are hidden_size / num_attention_heads"),
            (_with_config(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "RoPE scaling 'yarn'"),
            (_with_config(block_configs=blocks), r"block_configs\[1\].attention.window_length = 8"),
            (_with_config(num_hidden_layers=6), "5 block_configs for num_hidden_layers 6")):
        with pytest.raises(hf_mapping.ConversionError, match=message):
            hf_mapping.shape_from_hf_config(config, "DIR", None, PADDED_VOCAB, False)


def test_heterogeneous_models_export_as_decilm_only(tools):
    """Our flags pick DeciLM for heterogeneous layers; another architecture asked for, or a flag DeciLM cannot
    compute, is refused by name; so is DeciLM for uniform layers."""
    import dataclasses

    _, hf_mapping = tools
    shape, architecture = hf_mapping.shape_from_hf_config(CONFIG, "DIR", None, PADDED_VOCAB, False)
    assert architecture == hf_mapping.NEMOTRON_NAS == hf_mapping.architecture_for(shape)
    with pytest.raises(hf_mapping.ConversionError, match="--heterogeneous-layers-config-path: only DeciLMForCausalLM"):
        hf_mapping.architecture_for(shape, hf_mapping.LLAMA)
    with pytest.raises(hf_mapping.ConversionError, match="--normalization LayerNorm: .*; --qk-layernorm: "):
        hf_mapping.architecture_for(dataclasses.replace(shape, qk_layernorm=True, normalization="LayerNorm"))
    uniform = dataclasses.replace(shape, heterogeneous_layers_config_encoded_json=None)
    assert hf_mapping.architecture_for(uniform) == hf_mapping.LLAMA
    with pytest.raises(hf_mapping.ConversionError, match="no --heterogeneous-layers-config-path"):
        hf_mapping.architecture_for(uniform, hf_mapping.NEMOTRON_NAS)


def test_tensor_parallel_sizes_split_every_attention_layer(tools):
    """The import's advice names the TP sizes every layer splits at: the layer with one key/value head, none but 1."""
    import dataclasses

    convert_checkpoint, hf_mapping = tools
    shape, _ = hf_mapping.shape_from_hf_config(CONFIG, "DIR", None, PADDED_VOCAB, False)
    assert convert_checkpoint.tensor_parallel_sizes(shape) == [1]
    blocks = [{"attention": _attention(heads_in_group=2), "ffn": block["ffn"]} for block in BLOCK_CONFIGS]
    shape = dataclasses.replace(shape, heterogeneous_layers_config_encoded_json=json.dumps({"block_configs": blocks}))
    assert convert_checkpoint.tensor_parallel_sizes(shape) == [1, 2]


def _train_save_and_forward(flags, root):
    """On one rank: our model of TINY_GPT + `flags` after one step, its weights perturbed, saved in `root`; its
    logits."""
    from tests.unit_tests.dist_checkpointing.pretrain_helpers import TrainingState

    return train_save_and_forward(TrainingState(f"{flags} --ckpt-format torch_dist"), root, _tokens(), 0.2)


def _model_tensors(root):
    from megatron.core.dist_checkpointing import offline
    from megatron.training.checkpointing import iteration_dir_name, read_tracker

    state = offline.read_checkpoint(os.path.join(root, iteration_dir_name(read_tracker(root))))
    return offline.full_precision_model(state)


@pytest.mark.world_size(1)
def test_checkpoint_training_wrote_exports_and_imports_back(tools, tmp_path):
    """A model trained from a hand-written block_configs file (tied embeddings, --apply-layernorm-1p) exports as
    DeciLM: the reference computes our logits from the written tensors, the block configs are the file's, and the
    import gives every tensor back bit for bit."""
    from megatron.core.dist_checkpointing import safetensors_format
    from tests.unit_tests.dist_checkpointing.pretrain_helpers import TIED

    convert_checkpoint, _ = tools
    with open(tmp_path / "layers.json", "w") as stream:
        json.dump({"block_configs": BLOCK_CONFIGS}, stream)
    flags = (IMPORTED_FLAGS.replace(" --untie-embeddings-and-output-weights", "") + str(tmp_path / "layers.json")
             + f" --apply-layernorm-1p {TIED}")
    ours = run_on_ranks(1, _train_save_and_forward, flags, str(tmp_path / "trained"))[0]

    convert_checkpoint.to_hf(str(tmp_path / "trained"), str(tmp_path / "hf"))
    config = read_config(tmp_path / "hf")
    assert config["block_configs"] == BLOCK_CONFIGS and config["tie_word_embeddings"] is True
    assert (config["rope_scaling"], config["rms_norm_eps"]) == (ROPE_SCALING, CONFIG["rms_norm_eps"])
    written = safetensors_format.load_file(os.path.join(tmp_path, "hf", "model.safetensors"))[0]
    assert "lm_head.weight" not in written
    theirs = _reference_logits(written)
    assert_logits_close(theirs, ours, "DeciLM of a trained checkpoint", LOGITS_TOLERANCE * theirs.abs().max().item())

    convert_checkpoint.from_hf(str(tmp_path / "hf"), str(tmp_path / "back"))
    trained, back = _model_tensors(str(tmp_path / "trained")), _model_tensors(str(tmp_path / "back"))
    assert sorted(back) == sorted(trained)
    for name, tensor in trained.items():
        assert torch.equal(back[name], tensor), name
