"""tools/checkpoint --from hf on directories as transformers writes them (no megatron_extras.safetensors): the
architectures read as Llama (Mistral, Qwen2), sliding-window attention refused, and what the import tells
training (the flags it records and prints, the tokenizer left to the run).

Each model is a tiny one that transformers builds and saves here, with head_dim wider than hidden / heads,
grouped-query attention and an rms_norm_eps other than our default, so that a flag read wrong shows.
"""

import json
import os
import re
import shutil
import sys

import pytest
import torch

TOOLS = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", "tools", "checkpoint"))
VOCAB = 50
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=32, rms_norm_eps=1e-6)


@pytest.fixture(scope="module")
def tools():
    sys.path.insert(0, TOOLS)
    import convert_checkpoint
    import hf_mapping

    yield convert_checkpoint, hf_mapping
    sys.path.remove(TOOLS)


def _save_hf_model(directory, config_class, **overrides):
    """A transformers model of `config_class` with random weights (biases included) saved in `directory`."""
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config_class(**{**SHAPE, **overrides})).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(str(directory))
    return model


def _logits(model):
    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        return model(tokens).logits


def _exported_with_the_same_tensors(convert_checkpoint, root, output, original, expected_class):
    """Export checkpoint `root` to HF directory `output`; the model transformers loads from it is of
    `expected_class` and holds `original`'s tensors exactly."""
    import transformers

    convert_checkpoint.to_hf(str(root), str(output))
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(output), dtype=torch.float32).eval()
    assert type(exported).__name__ == expected_class
    tensors = exported.state_dict()
    for name, tensor in original.state_dict().items():
        assert torch.equal(tensors[name], tensor), name
    return exported


def _recorded_args(root):
    from megatron.core.dist_checkpointing import offline
    from megatron.training.checkpointing import iteration_dir_name, read_tracker

    state = offline.read_checkpoint(os.path.join(root, iteration_dir_name(read_tracker(root))))
    return state["common"]


@pytest.mark.parametrize("kind", ["qwen2", "mistral"])
def test_qwen2_and_mistral_export_as_themselves_or_as_llama(kind, tools, tmp_path):
    """Qwen2 (biases on q, k and v only, tied) and Mistral without a sliding window compute as Llama does: the
    import records those flags; exported again the model is its own architecture, or with --hf-architecture
    LlamaForCausalLM a Llama, and either gives transformers' own logits."""
    import transformers

    convert_checkpoint, hf_mapping = tools
    if kind == "qwen2":
        original = _save_hf_model(tmp_path / "hf", transformers.Qwen2Config, tie_word_embeddings=True,
                                  rope_theta=1e6)
    else:
        original = _save_hf_model(tmp_path / "hf", transformers.MistralConfig, sliding_window=None,
                                  tie_word_embeddings=False)
    convert_checkpoint.from_hf(str(tmp_path / "hf"), str(tmp_path / "ours"))
    args = _recorded_args(str(tmp_path / "ours"))["args"]
    assert (args.add_qkv_bias, args.add_bias_linear) == ((True, False) if kind == "qwen2" else (False, False))
    assert args.untie_embeddings_and_output_weights == (kind == "mistral")
    assert (args.kv_channels, args.num_query_groups, args.norm_epsilon) == (16, 2, 1e-6)
    assert args.rotary_base == (1e6 if kind == "qwen2" else 10000.0)

    itself = _exported_with_the_same_tensors(convert_checkpoint, tmp_path / "ours", tmp_path / "back", original,
                                             type(original).__name__)
    assert sorted(itself.state_dict()) == sorted(original.state_dict())  # Qwen2: no o_proj bias added
    assert torch.equal(_logits(itself), _logits(original))
    convert_checkpoint.to_hf(str(tmp_path / "ours"), str(tmp_path / "llama"), architecture=hf_mapping.LLAMA)
    llama = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "llama"), dtype=torch.float32).eval()
    assert type(llama).__name__ == "LlamaForCausalLM"
    assert torch.allclose(_logits(llama), _logits(original), rtol=0, atol=1e-5)


def _config(directory):
    with open(os.path.join(directory, "config.json")) as stream:
        return json.load(stream)


def _dtype(config):
    return config.get("dtype", config.get("torch_dtype"))


def _rope_theta(config):
    return (config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta"))


def _hf_tensors(directory):
    from megatron.core.dist_checkpointing import safetensors_format

    return safetensors_format.load_file(os.path.join(directory, "model.safetensors"))[0]


FAMILIES = {"qwen2": ("Qwen2Config", dict(tie_word_embeddings=True, rope_theta=1e6)),
            "mistral": ("MistralConfig", dict(sliding_window=None, rope_theta=5e5)),
            "qwen3": ("Qwen3Config", dict(tie_word_embeddings=False))}


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_bf16_round_trip_keeps_the_architecture_config_and_tensors(kind, tools, tmp_path):
    """HF (bf16) -> ours -> HF: the same architecture, config fields and bf16 tensors, bit for bit."""
    import transformers

    convert_checkpoint, _ = tools
    config_class, overrides = FAMILIES[kind]
    original = _save_hf_model(tmp_path / "hf", getattr(transformers, config_class), **overrides)
    original.to(torch.bfloat16).save_pretrained(str(tmp_path / "hf"))
    convert_checkpoint.from_hf(str(tmp_path / "hf"), str(tmp_path / "ours"))
    convert_checkpoint.to_hf(str(tmp_path / "ours"), str(tmp_path / "back"))

    before, after = _config(tmp_path / "hf"), _config(tmp_path / "back")
    for key in ("architectures", "model_type", "attention_bias", "mlp_bias", "vocab_size", "head_dim",
                "num_key_value_heads", "tie_word_embeddings", "rms_norm_eps", "sliding_window", "use_sliding_window",
                "layer_types", "bos_token_id", "eos_token_id", "pad_token_id"):
        assert after.get(key) == before.get(key), key
    assert (_dtype(before), _dtype(after)) == ("bfloat16", "bfloat16")
    assert _rope_theta(after) == _rope_theta(before) == overrides.get("rope_theta", 10000.0)
    theirs, ours = _hf_tensors(tmp_path / "hf"), _hf_tensors(tmp_path / "back")
    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():
        assert ours[name].dtype == torch.bfloat16 and torch.equal(ours[name], tensor), name
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"))
    assert type(loaded).__name__ == type(original).__name__ and loaded.dtype == torch.bfloat16


def _as_trained(root, **training_args):
    """Checkpoint `root` as a training run saves it: its own arguments (with `training_args`), no record of the
    import."""
    from megatron.core.dist_checkpointing import offline
    from megatron.training.checkpointing import iteration_dir_name, read_tracker

    iteration = read_tracker(root)
    state = offline.read_checkpoint(os.path.join(root, iteration_dir_name(iteration)))
    common = dict(state["common"])
    del common["hf_source"]
    args = common["args"]
    for name, value in training_args.items():
        setattr(args, name, value)
    state["common"] = common
    shutil.rmtree(root)
    offline.write_checkpoint(root, iteration, state, common["layout"])


def test_export_after_training_takes_the_dtype_and_architecture_from_the_flags(tools, tmp_path):
    """A checkpoint that training wrote (no record of the import) exports in the dtype it trained in; our flags
    pick the architecture, --hf-architecture another that computes the same, and one that does not is refused."""
    import transformers

    convert_checkpoint, hf_mapping = tools
    original = _save_hf_model(tmp_path / "hf", transformers.Qwen2Config, tie_word_embeddings=True)
    convert_checkpoint.from_hf(str(tmp_path / "hf"), str(tmp_path / "ours"))
    _as_trained(str(tmp_path / "ours"), bf16=True, fp16=False)
    written = convert_checkpoint.to_hf(str(tmp_path / "ours"), str(tmp_path / "llama"))
    assert _config(tmp_path / "llama")["architectures"] == ["LlamaForCausalLM"]  # our flags alone
    assert _dtype(_config(tmp_path / "llama")) == "bfloat16"
    assert {tensor.dtype for tensor in written.values()} == {torch.bfloat16}

    convert_checkpoint.main(["--to", "hf", "--input", str(tmp_path / "ours"), "--output", str(tmp_path / "qwen2"),
                             "--hf-architecture", "Qwen2ForCausalLM", "--hf-dtype", "float32"])
    assert _config(tmp_path / "qwen2")["model_type"] == "qwen2" and _dtype(_config(tmp_path / "qwen2")) == "float32"
    theirs = _hf_tensors(tmp_path / "qwen2")
    assert all(torch.equal(theirs[name], tensor) for name, tensor in original.state_dict().items()
               if name != "lm_head.weight")
    for architecture, flag in ((hf_mapping.MISTRAL, "--add-qkv-bias: MistralForCausalLM has no biases"),
                               (hf_mapping.QWEN3, "no --qk-layernorm: Qwen3ForCausalLM normalises"),
                               (hf_mapping.GPT2, "--position-embedding-type rope: GPT-2 learns absolute")):
        with pytest.raises(SystemExit, match=f"as --hf-architecture asks.*{flag}"):
            convert_checkpoint.to_hf(str(tmp_path / "ours"), str(tmp_path / "refused"), architecture=architecture)


def test_sliding_window_attention_is_refused_naming_the_field(tools, tmp_path):
    import transformers

    convert_checkpoint, _ = tools
    _save_hf_model(tmp_path / "mistral", transformers.MistralConfig, sliding_window=8)
    with pytest.raises(SystemExit, match="sliding_window 8 below max_position_embeddings 32"):
        convert_checkpoint.from_hf(str(tmp_path / "mistral"), str(tmp_path / "out"))
    # a window that covers every position changes nothing
    _save_hf_model(tmp_path / "wide", transformers.MistralConfig, sliding_window=32)
    convert_checkpoint.from_hf(str(tmp_path / "wide"), str(tmp_path / "wide_ours"))
    config = dict(SHAPE, model_type="qwen2", architectures=["Qwen2ForCausalLM"], use_sliding_window=True,
                  sliding_window=8, max_window_layers=0)
    os.makedirs(tmp_path / "qwen2")
    with open(tmp_path / "qwen2" / "config.json", "w") as stream:
        json.dump(config, stream)
    with pytest.raises(SystemExit, match="sliding-window attention .*use_sliding_window"):
        convert_checkpoint.from_hf(str(tmp_path / "qwen2"), str(tmp_path / "out"))


def test_qwen2_whose_window_starts_past_the_last_layer_and_swish_import_as_full_attention_silu(tools, tmp_path):
    """Qwen2 with use_sliding_window true slides only from layer max_window_layers on: with max_window_layers
    >= num_hidden_layers (and no layer_types) every layer attends to all earlier positions; hidden_act 'swish' is
    transformers' other name of silu. Both import, and the export (full attention, silu) gives transformers'
    logits; a window starting at layer 1 is refused naming the layers."""
    import transformers

    convert_checkpoint, hf_mapping = tools
    original = _save_hf_model(tmp_path / "hf", transformers.Qwen2Config, use_sliding_window=True, sliding_window=4,
                              max_window_layers=2, hidden_act="swish")
    assert original.config.layer_types == ["full_attention"] * 2  # transformers' own reading
    config = _config(tmp_path / "hf")
    del config["layer_types"]  # as older transformers wrote it: the rule alone decides
    with open(tmp_path / "hf" / "config.json", "w") as stream:
        json.dump(config, stream)
    convert_checkpoint.from_hf(str(tmp_path / "hf"), str(tmp_path / "ours"))
    back = _exported_with_the_same_tensors(convert_checkpoint, tmp_path / "ours", tmp_path / "back", original,
                                           "Qwen2ForCausalLM")
    assert (back.config.hidden_act, back.config.layer_types) == ("silu", ["full_attention"] * 2)
    assert torch.equal(_logits(back), _logits(original))
    with pytest.raises(hf_mapping.ConversionError, match=r"^DIR: sliding-window attention in layers \[1\] "
                       r"\(config.json use_sliding_window True, sliding_window 4, max_window_layers 1"):
        hf_mapping.shape_from_hf_config({**config, "max_window_layers": 1}, "DIR", None, 64, False)


def test_gpt2_round_trip_keeps_the_activation_name_and_transformers_logits(tools, tmp_path):
    """GPT-2's gelu_new and gelu_pytorch_tanh are both --openai-gelu but transformers computes them a little
    differently: the model written back keeps the name it came with (and n_inner null, reorder_and_upcast_attn),
    so it computes exactly the logits of the one imported."""
    import transformers

    convert_checkpoint, _ = tools
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                     reorder_and_upcast_attn=True, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    original = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for param in original.parameters():
            param.add_(0.5 * torch.randn_like(param))
    original.save_pretrained(str(tmp_path / "hf"))
    convert_checkpoint.from_hf(str(tmp_path / "hf"), str(tmp_path / "ours"))
    back = _exported_with_the_same_tensors(convert_checkpoint, tmp_path / "ours", tmp_path / "back", original,
                                           "GPT2LMHeadModel")
    written = _config(tmp_path / "back")
    assert (written["activation_function"], written["n_inner"], written["reorder_and_upcast_attn"]) == (
        "gelu_new", None, True)
    assert torch.equal(_logits(back), _logits(original))


MOE_COUNTS = dict(num_experts_per_tok=4, moe_intermediate_size=24)
MINIMAL_CONFIGS = {  # config class: what config.json must say (the rest left to the class defaults)
    "MistralConfig": {}, "MixtralConfig": dict(num_local_experts=8, num_experts_per_tok=2), "Qwen2Config": {},
    "Qwen3Config": {}, "Qwen3MoeConfig": dict(num_experts=8, **MOE_COUNTS),
    "Qwen2MoeConfig": dict(num_experts=8, shared_expert_intermediate_size=24, **MOE_COUNTS),
    "DeepseekV3Config": dict(n_routed_experts=16, num_experts_per_tok=8, moe_intermediate_size=24, q_lora_rank=None,
                             kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4),
}


@pytest.mark.parametrize("config_class", list(MINIMAL_CONFIGS))
def test_keys_config_json_omits_read_as_the_transformers_class_defaults(config_class):
    """A config.json without rms_norm_eps, rope_theta, num_key_value_heads, head_dim or the router's groups means
    what transformers' config class defaults to (Mixtral's epsilon 1e-5 and RoPE base 1e6, Qwen3's head_dim 128,
    DeepSeek-V3's 8 groups, scaling 2.5 and 3 dense layers), not Llama's."""
    import transformers

    sys.path.insert(0, TOOLS)
    try:
        import hf_config
    finally:
        sys.path.remove(TOOLS)
    hidden_only = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                       num_attention_heads=32, max_position_embeddings=4096, **MINIMAL_CONFIGS[config_class])
    theirs = getattr(transformers, config_class)(**hidden_only)
    config = {"model_type": theirs.model_type, **hidden_only}
    shape, _ = hf_config.shape_from_hf_config(config, "hf", None, 64, False)
    assert shape.norm_epsilon == theirs.rms_norm_eps
    assert shape.rotary_base == theirs.rope_parameters["rope_theta"]
    if config_class == "DeepseekV3Config":
        assert (shape.moe_router_num_groups, shape.moe_router_group_topk) == (theirs.n_group, theirs.topk_group)
        assert shape.moe_router_topk_scaling_factor == theirs.routed_scaling_factor
        assert shape.moe_layer_freq == [0] * theirs.first_k_dense_replace + [1]
        return
    assert shape.num_query_groups == theirs.num_key_value_heads
    assert shape.kv_channels == (getattr(theirs, "head_dim", None) or theirs.hidden_size // theirs.num_attention_heads)


def test_mistral_without_sliding_window_key_has_transformers_4096_window(tools, tmp_path):
    """MistralConfig's sliding_window defaults to 4096: a config.json without the key, for a longer context, is
    refused as sliding-window attention, as one that says so."""
    convert_checkpoint, _ = tools
    os.makedirs(tmp_path / "mistral")
    with open(tmp_path / "mistral" / "config.json", "w") as stream:
        json.dump(dict(SHAPE, model_type="mistral", max_position_embeddings=32768), stream)
    with pytest.raises(SystemExit, match="sliding_window 4096 below max_position_embeddings 32768"):
        convert_checkpoint.from_hf(str(tmp_path / "mistral"), str(tmp_path / "out"))


def test_use_checkpoint_args_keeps_the_runs_tokenizer(tools, tmp_path):
    """HF's tokenizer is none of ours: --use-checkpoint-args takes the imported model's flags and leaves the
    run's --tokenizer-type and --vocab-size, which then match the recorded vocabulary."""
    import transformers
    from megatron.training.arguments import build_parser
    from megatron.training.checkpoint_args import apply_checkpoint_args, check_same_architecture, true_vocab_size

    convert_checkpoint, _ = tools
    _save_hf_model(tmp_path / "hf", transformers.LlamaConfig)
    convert_checkpoint.from_hf(str(tmp_path / "hf"), str(tmp_path / "ours"))
    common = _recorded_args(str(tmp_path / "ours"))
    run = build_parser().parse_args(f"--tokenizer-type NullTokenizer --vocab-size {VOCAB - 1}".split())
    apply_checkpoint_args(run, common["args"])
    assert (run.tokenizer_type, run.vocab_size) == ("NullTokenizer", VOCAB - 1)
    assert (run.kv_channels, run.norm_epsilon, run.swiglu, run.normalization) == (16, 1e-6, True, "RMSNorm")
    assert common["vocab_size"] == true_vocab_size(run) == VOCAB
    check_same_architecture("imported", common["args"], run, common["vocab_size"], true_vocab_size(run))


def _save_tokenizer(directory, tokens):
    """A word-level tokenizer.json of `tokens` tokens (the last one <|endoftext|>) in `directory`."""
    import tokenizers

    vocab = {f"w{index}": index for index in range(tokens - 1)}
    vocab["<|endoftext|>"] = tokens - 1
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.save(os.path.join(directory, "tokenizer.json"))


def test_export_after_training_takes_the_token_ids_from_the_runs_tokenizer(tools, tmp_path):
    """A checkpoint that training wrote records no HF token ids: config.json gets the end-of-document id of the
    tokenizer the run trained with (where generation stops), and none where that tokenizer is gone."""
    import transformers

    convert_checkpoint, _ = tools
    _save_hf_model(tmp_path / "hf", transformers.LlamaConfig, bos_token_id=None, eos_token_id=None)
    os.makedirs(tmp_path / "tokenizer")
    _save_tokenizer(tmp_path / "tokenizer", VOCAB)
    convert_checkpoint.from_hf(str(tmp_path / "hf"), str(tmp_path / "ours"))
    _as_trained(str(tmp_path / "ours"), tokenizer_type="HuggingFaceTokenizer",
                tokenizer_model=str(tmp_path / "tokenizer"))
    convert_checkpoint.to_hf(str(tmp_path / "ours"), str(tmp_path / "back"))
    config = _config(tmp_path / "back")
    assert (config["eos_token_id"], config["bos_token_id"], config["pad_token_id"]) == (VOCAB - 1, None, None)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"))
    assert loaded.generation_config.eos_token_id == VOCAB - 1

    shutil.rmtree(tmp_path / "tokenizer")
    convert_checkpoint.to_hf(str(tmp_path / "ours"), str(tmp_path / "without"), vocab_size=VOCAB)
    assert _config(tmp_path / "without")["eos_token_id"] is None


def test_tokenizer_smaller_than_the_embedding_trains_with_the_padding_that_fills_it(tools, tmp_path, capsys):
    """Qwen2's embedding has more rows (151936) than its tokenizer has tokens: the rows are that tokenizer's
    padded vocabulary. The import records the tokenizer's size, so training with it and the printed
    --make-vocab-size-divisible-by (which pads it to the rows) passes the load's check; --to hf keeps the rows."""
    import transformers
    from megatron.core.dist_checkpointing.serialization import CheckpointError
    from megatron.training.arguments import build_parser
    from megatron.training.checkpoint_args import apply_checkpoint_args, check_same_architecture, true_vocab_size
    from megatron.training.tokenizer import pad_vocab_size

    convert_checkpoint, _ = tools
    tokens = 40
    _save_hf_model(tmp_path / "hf", transformers.Qwen2Config, tie_word_embeddings=True)
    _save_tokenizer(tmp_path / "hf", tokens)
    convert_checkpoint.main(["--from", "hf", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "ours"),
                             "--make-vocab-size-divisible-by", str(VOCAB)])
    printed = capsys.readouterr().out
    assert f"--make-vocab-size-divisible-by 25, which pads its {tokens} tokens to the embedding's {VOCAB} rows" in \
        printed and f"NullTokenizer --vocab-size {tokens - 1}" in printed
    assert pad_vocab_size(tokens, 25) == VOCAB
    common = _recorded_args(str(tmp_path / "ours"))
    assert common["vocab_size"] == tokens
    run = build_parser().parse_args(f"--tokenizer-type HuggingFaceTokenizer --tokenizer-model {tmp_path / 'hf'} "
                                    "--make-vocab-size-divisible-by 25".split())
    apply_checkpoint_args(run, common["args"])
    assert true_vocab_size(run) == tokens
    check_same_architecture("imported", common["args"], run, common["vocab_size"], true_vocab_size(run))
    other = build_parser().parse_args(f"--tokenizer-type NullTokenizer --vocab-size {VOCAB - 1}".split())
    with pytest.raises(CheckpointError, match=f"{tokens} in the checkpoint, {VOCAB} in this run"):
        check_same_architecture("imported", common["args"], other, common["vocab_size"], true_vocab_size(other))

    convert_checkpoint.to_hf(str(tmp_path / "ours"), str(tmp_path / "back"))
    assert _config(tmp_path / "back")["vocab_size"] == VOCAB
    assert _hf_tensors(tmp_path / "back")["model.embed_tokens.weight"].shape == (VOCAB, 32)


def test_import_prints_the_flags_that_rebuild_the_model(tools, tmp_path, capsys):
    """The model flags --from hf prints, given to training's parser, are the model the checkpoint records."""
    import transformers
    from megatron.training.arguments import build_parser
    from megatron.training.checkpoint_args import MODEL_ARGS, architecture_differences

    convert_checkpoint, _ = tools
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    _save_hf_model(tmp_path / "hf", transformers.LlamaConfig, rope_theta=1e6, rope_scaling=scaling,
                   attention_bias=True, mlp_bias=True)
    convert_checkpoint.main(["--from", "hf", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "ours")])
    printed = capsys.readouterr().out
    assert f"--load {tmp_path / 'ours'} --finetune --use-checkpoint-args" in printed
    assert f"--tokenizer-type NullTokenizer --vocab-size {VOCAB - 1}" in printed
    flags = next(line for line in printed.splitlines() if line.startswith("model flags: "))[len("model flags: "):]
    parsed = build_parser().parse_args(flags.split())
    recorded = _recorded_args(str(tmp_path / "ours"))["args"]
    assert architecture_differences(recorded, parsed) == []
    compared = [name for name in MODEL_ARGS if hasattr(recorded, name) and name != "kv_channels"]
    assert len(compared) >= 20
    assert {name: getattr(parsed, name) for name in compared} == {name: getattr(recorded, name) for name in compared}
    assert (parsed.kv_channels, parsed.rope_scaling_factor, parsed.norm_epsilon) == (16, 8.0, 1e-6)


def test_qwen3_query_key_norms_follow_the_rows_of_interleaved_rope(tools, tmp_path):
    """With --rotary-interleaved the q and k rows of each head are permuted for HF; the q / k norm weights scale
    those channels, so they are permuted alike: HF's norm channel j must hold the weight of the row HF puts at j."""
    import dataclasses

    import transformers

    convert_checkpoint, hf_mapping = tools
    _save_hf_model(tmp_path / "hf", transformers.Qwen3Config, tie_word_embeddings=True)
    model = convert_checkpoint.from_hf(str(tmp_path / "hf"), str(tmp_path / "ours"))
    shape = hf_mapping.ModelShape.from_args(_recorded_args(str(tmp_path / "ours"))["args"], VOCAB, 128)
    assert shape.qk_layernorm and shape.kv_channels == 16
    shape = dataclasses.replace(shape, rotary_interleaved=True)
    # each q / k row and each norm channel holds its channel index within the head
    channel = torch.arange(16.0)
    for layer in range(2):
        ours = f"decoder.layers.{layer}.self_attention."
        model[ours + "linear_qkv.weight"] = channel.repeat(model[ours + "linear_qkv.weight"].shape[0] // 16)[:, None] \
            .expand_as(model[ours + "linear_qkv.weight"]).clone()
        model[ours + "q_layernorm.weight"], model[ours + "k_layernorm.weight"] = channel.clone(), channel + 100
    hf_tensors, _ = hf_mapping.to_hf_tensors(model, shape, hf_mapping.QWEN3)
    for layer in range(2):
        theirs = f"model.layers.{layer}.self_attn."
        assert not torch.equal(hf_tensors[theirs + "q_norm.weight"], channel)
        for projection, norm, offset in (("q_proj", "q_norm", 0), ("k_proj", "k_norm", 100)):
            rows = hf_tensors[theirs + projection + ".weight"][:, 0].reshape(-1, 16)
            assert torch.equal(rows + offset, hf_tensors[theirs + norm + ".weight"].expand_as(rows))
    back = hf_mapping.from_hf_tensors(hf_tensors, {}, shape, hf_mapping.QWEN3, "HF")
    assert all(torch.equal(back[name], tensor) for name, tensor in model.items())


def test_qwen3_imports_and_exports_as_qwen3(tools, tmp_path):
    import transformers

    convert_checkpoint, _ = tools
    original = _save_hf_model(tmp_path / "hf", transformers.Qwen3Config, tie_word_embeddings=True)
    convert_checkpoint.from_hf(str(tmp_path / "hf"), str(tmp_path / "ours"))
    args = _recorded_args(str(tmp_path / "ours"))["args"]
    assert (args.qk_layernorm, args.add_qkv_bias, args.add_bias_linear, args.kv_channels) == (True, False, False, 16)
    back = _exported_with_the_same_tensors(convert_checkpoint, tmp_path / "ours", tmp_path / "back", original,
                                           "Qwen3ForCausalLM")
    assert torch.equal(_logits(back), _logits(original))


def _training_run(flags, common, use_checkpoint_args=True):
    """Training's arguments for `flags` after --use-checkpoint-args takes `common`'s model (or, without it, with the
    model flags `common` records given on the command line), with the padded vocabulary training sets up before it
    loads."""
    from megatron.training.arguments import build_parser
    from megatron.training.checkpoint_args import apply_checkpoint_args, true_vocab_size
    from megatron.training.tokenizer.tokenizer import padded_vocab_size

    run = build_parser().parse_args((flags + (" --use-checkpoint-args" if use_checkpoint_args else "")).split())
    apply_checkpoint_args(run, common["args"])
    run.padded_vocab_size = padded_vocab_size(run, true_vocab_size(run))
    return run


def test_directory_without_a_tokenizer_names_none_and_records_the_padding_of_its_rows(tools, tmp_path, capsys):
    """A directory --to hf wrote holds no tokenizer: the advice asks for the tokenizer the model trained with
    instead of naming the directory's. The import records (and prints) the --make-vocab-size-divisible-by that
    pads the vocabulary to the embedding's rows, per TP size, so that --use-checkpoint-args rebuilds those rows."""
    import transformers
    from megatron.training.checkpoint_args import check_same_architecture, true_vocab_size

    convert_checkpoint, _ = tools
    _save_hf_model(tmp_path / "hf", transformers.LlamaConfig)  # 4 heads, 2 key/value heads: TP 1 or 2
    convert_checkpoint.main(["--from", "hf", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "ours")])
    printed = capsys.readouterr().out
    assert "HuggingFaceTokenizer" not in printed
    assert f"the one the model was trained with ({tmp_path / 'hf'} holds no tokenizer" in printed
    # 50 tokens in 128 rows: D x TP divides 128 and exceeds 78
    assert (f"--make-vocab-size-divisible-by 128, which pads its {VOCAB} tokens to the embedding's 128 rows at TP 1 "
            "(64 at TP 2, given with the model flags in place of --use-checkpoint-args, which keeps the embedding's "
            "128 rows at any TP size that divides them)") in printed
    flags = next(line for line in printed.splitlines() if line.startswith("model flags: "))
    assert flags.endswith(" --make-vocab-size-divisible-by 128")
    common = _recorded_args(str(tmp_path / "ours"))
    assert (common["args"].make_vocab_size_divisible_by, common["args"].padded_vocab_size) == (128, 128)
    for tp in (1, 2):
        run = _training_run(f"--tokenizer-type NullTokenizer --vocab-size {VOCAB - 1} --make-vocab-size-divisible-by "
                            f"8 --tensor-model-parallel-size {tp}", common)
        assert run.padded_vocab_size == 128  # the recorded rows, whatever the command line's divisor and TP
        check_same_architecture("imported", common["args"], run, common["vocab_size"], true_vocab_size(run))

    _save_tokenizer(tmp_path / "hf", VOCAB)
    convert_checkpoint.main(["--from", "hf", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "again")])
    assert f"--tokenizer-type HuggingFaceTokenizer --tokenizer-model {tmp_path / 'hf'}" in capsys.readouterr().out


def test_tokenizer_padded_to_the_rows_of_a_directory_without_one_trains_from_it(tools, tmp_path, capsys):
    """Without a tokenizer and with config.json's vocab_size at the rows, the checkpoint records the rows as its
    vocabulary and no padding: a run's tokenizer of fewer tokens loads it with --use-checkpoint-args (which takes
    the rows) or, given the model flags instead, padded to exactly those rows by the --make-vocab-size-divisible-by
    the run gives; padded to other rows it is refused, naming the one that fits."""
    import transformers
    from megatron.core.dist_checkpointing.serialization import CheckpointError
    from megatron.training.checkpoint_args import check_same_architecture, true_vocab_size

    convert_checkpoint, _ = tools
    tokens = 40
    _save_hf_model(tmp_path / "hf", transformers.Qwen2Config, tie_word_embeddings=True)
    convert_checkpoint.main(["--from", "hf", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "ours"),
                             "--make-vocab-size-divisible-by", str(VOCAB)])
    printed = capsys.readouterr().out
    assert f"the checkpoint records its {VOCAB} embedding rows as its vocabulary" in printed
    assert "HuggingFaceTokenizer" not in printed and "model flags: " in printed
    assert "--make-vocab-size-divisible-by" not in printed.split("model flags: ")[1]
    common = _recorded_args(str(tmp_path / "ours"))
    assert common["vocab_size"] == VOCAB and not hasattr(common["args"], "make_vocab_size_divisible_by")
    os.makedirs(tmp_path / "tokenizer")
    _save_tokenizer(tmp_path / "tokenizer", tokens)
    tokenizer = f"--tokenizer-type HuggingFaceTokenizer --tokenizer-model {tmp_path / 'tokenizer'}"
    for run in (_training_run(tokenizer, common), _training_run(f"{tokenizer} --make-vocab-size-divisible-by 25",
                                                                common, use_checkpoint_args=False)):
        assert (true_vocab_size(run), run.padded_vocab_size) == (tokens, VOCAB)
        check_same_architecture("imported", common["args"], run, common["vocab_size"], true_vocab_size(run))
    run = _training_run(tokenizer, common, use_checkpoint_args=False)  # the default 128 pads to 128 rows
    with pytest.raises(CheckpointError, match=f"{VOCAB} in the checkpoint, {tokens} in this run.*--make-vocab-size-"
                                              f"divisible-by 25, which pads them to exactly {VOCAB} at TP 1"):
        check_same_architecture("imported", common["args"], run, common["vocab_size"], true_vocab_size(run))


@pytest.mark.parametrize("config_class", ["Qwen2Config", "Qwen3Config", "Qwen2MoeConfig"])
def test_sliding_layers_follow_transformers_rule(config_class, tools):
    """Without layer_types, the layers the import refuses as sliding are those transformers' config class marks
    `sliding_attention` (Qwen2 / Qwen3: from max_window_layers on; Qwen2-MoE: the even ones below it)."""
    import transformers

    _, hf_mapping = tools
    model_type = getattr(transformers, config_class).model_type
    for max_window_layers in (0, 1, 3, 4, 28):
        keys = dict(num_hidden_layers=4, use_sliding_window=True, sliding_window=4, max_window_layers=max_window_layers)
        theirs = getattr(transformers, config_class)(**keys).layer_types
        sliding = [index for index, kind in enumerate(theirs) if kind == "sliding_attention"]
        config = dict(SHAPE, model_type=model_type, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                      shared_expert_intermediate_size=8, **keys)
        if not sliding:
            hf_mapping.shape_from_hf_config(config, "DIR", None, 64, False)
            continue
        message = re.escape(f"sliding-window attention in layers {sliding} ")
        with pytest.raises(hf_mapping.ConversionError, match=message):
            hf_mapping.shape_from_hf_config(config, "DIR", None, 64, False)
