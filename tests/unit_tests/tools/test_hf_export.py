"""tools/checkpoint --to hf / --from hf: the exported directory is a Hugging Face model that computes our model's
logits, and converting it back gives the checkpoint's tensors bit for bit.

Six small models (TINY_GPT's shape) cover the three architectures and the flags the mapping has to get right:
GPT-2 style (tied, GeLU, biases), GPT-2 style with --apply-layernorm-1p and --disable-bias-linear (untied),
Llama style with grouped-query attention and Llama 3.1's RoPE scaling (untied, no biases), Llama style with
multi-query attention, biases, --apply-layernorm-1p and another --rotary-base (tied), Llama style with
interleaved, position-interpolated RoPE and only a QKV bias (--add-qkv-bias) and Qwen3 style (--qk-layernorm,
--kv-channels wider than hidden / heads, --apply-layernorm-1p, a QKV bias); a seventh, FP8-trained, carries amax
histories through the round trip. Their weights are perturbed randomly so that norms, biases and
padding rows all hold distinct values.
"""

import argparse
import itertools
import json
import os
import shutil
import sys
from unittest import mock

import pytest
import torch

from tests.unit_tests.dist_checkpointing import pretrain_helpers
from tests.unit_tests.multiprocess_harness import run_on_ranks

TOOLS = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", "tools", "checkpoint"))
LLAMA = "--normalization RMSNorm --position-embedding-type rope --swiglu"
ROPE_SCALING = "--rotary-base 1000000 --use-rope-scaling --rope-scaling-factor 32"
# name: (TINY_GPT flags added, whether TINY_GPT's --swiglu stays)
MODELS = {
    "gpt2": ("TIED", False),
    "gpt2_1p_no_bias": ("--apply-layernorm-1p --disable-bias-linear", False),
    # base 1e6 on heads of 8 channels: wavelengths 6, 199, 6283 and 198692 positions, so Llama 3.1's scaling keeps
    # two frequencies, blends one and divides one
    "llama_gqa_rope_scaling": (f"{LLAMA} --disable-bias-linear --group-query-attention --num-query-groups 2 "
                               f"{ROPE_SCALING}", True),
    "llama_mqa_bias_1p_tied": (f"TIED {LLAMA} --apply-layernorm-1p --rotary-base 500 --group-query-attention "
                               "--num-query-groups 1", True),
    # interleaved pairs: q and k rows are permuted per head; interpolated positions: HF's "linear" RoPE scaling
    "llama_interleaved_interpolated_qkv_bias": (f"{LLAMA} --disable-bias-linear --add-qkv-bias --group-query-attention "
                                                "--num-query-groups 2 --rotary-interleaved "
                                                "--rotary-seq-len-interpolation-factor 2", True),
    # query and key norms: HF's Qwen3 (heads wider than hidden / heads, zero-centred norms, a QKV bias)
    "qwen3_qk_norm_1p_qkv_bias": (f"{LLAMA} --disable-bias-linear --add-qkv-bias --qk-layernorm --apply-layernorm-1p "
                                  "--kv-channels 16 --group-query-attention --num-query-groups 2", True),
    # FP8 training keeps amax histories in the model's state: they travel in the extras (no logits test: the
    # model computes its GEMMs in FP8, HF in fp32)
    "llama_gqa_fp8": (f"{LLAMA} --disable-bias-linear --group-query-attention --num-query-groups 2 "
                      "--fp8-format hybrid --fp8-amax-history-len 4", True),
}
FP32_MODELS = [name for name in MODELS if "fp8" not in name]
# TINY_GPT: NullTokenizer --vocab-size 120 (the text ids 0..119 and the eod 120) --make-vocab-size-divisible-by 64
VOCAB, PADDED_VOCAB, SEQUENCE = 120 + 1, 128, 16
# fp32 on CPU. Measured with transformers 5.24: GPT-2 style 0 (the same torch ops in the same order), Llama style
# 6e-7 on logits of magnitude ~2 (HF's RMSNorm computes x * rsqrt(mean(x^2) + eps) by hand where we call
# F.rms_norm, and its attention repeats the key/value heads where we pass enable_gqa): rounding only, and the
# bound leaves more than an order of magnitude.
LOGITS_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def tools():
    sys.path.insert(0, TOOLS)
    import convert_checkpoint
    import hf_mapping

    yield convert_checkpoint, hf_mapping
    sys.path.remove(TOOLS)


def _tokens():
    generator = torch.Generator().manual_seed(1234)
    return torch.randint(0, VOCAB, (3, SEQUENCE), generator=generator)


def _training_state(name, more_args=""):
    """TrainingState of model `name` (TINY_GPT without its --swiglu for the GeLU models)."""
    extra_args, gated = MODELS[name]
    tiny_gpt = pretrain_helpers.TINY_GPT if gated else pretrain_helpers.TINY_GPT.replace(" --swiglu", "")
    with mock.patch.object(pretrain_helpers, "TINY_GPT", tiny_gpt):
        return pretrain_helpers.TrainingState(f"{extra_args} --ckpt-format torch_dist {more_args}")


def _logits(model):
    model.eval()
    tokens = _tokens()
    with torch.no_grad():
        return model(tokens, torch.arange(SEQUENCE).expand_as(tokens)).clone()


def _save_and_forward(workdir, names):
    """On one rank: build each model, perturb its weights, save it (torch_dist); returns its logits and the
    frequencies of its rotary embedding (None without RoPE)."""
    from megatron.core.distributed.data_parallel_base import unwrap_model
    from megatron.core.fp8_utils import reduce_fp8_amaxes
    from megatron.training import checkpointing

    logits, rope_frequencies = {}, {}
    generator = torch.Generator().manual_seed(7)
    for name in names:
        state = _training_state(name)
        try:
            state.train_steps(1)
            with torch.no_grad():
                for param in state.model[0].parameters():
                    param.add_(0.1 * torch.randn(param.shape, generator=generator))
            logits[name] = _logits(state.model[0])  # first, so that an FP8 model saves recorded amaxes
            rotary = unwrap_model(state.model[0]).rotary_pos_emb
            rope_frequencies[name] = rotary.inverse_frequencies("cpu") if rotary is not None else None
            reduce_fp8_amaxes(state.model)  # as a training step does: the pass's pending amaxes enter the histories
            state.args.save = os.path.join(workdir, name)
            checkpointing.save_checkpoint(1, state.model, state.optimizer, state.scheduler, state.args)
        finally:
            state.close()
    return logits, rope_frequencies


def _load_and_forward(name, root):
    """On one rank: model `name` loaded from `root` as training loads it (--finetune); its logits."""
    from megatron.training import checkpointing

    state = _training_state(name, f"--load {root} --finetune")
    try:
        checkpointing.load_checkpoint(state.model, state.optimizer, state.scheduler, state.args)
        return _logits(state.model[0])
    finally:
        state.close()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(directory of the checkpoints, {name: our logits}, {name: our RoPE frequencies or None})."""
    workdir = str(tmp_path_factory.mktemp("hf_export"))
    return (workdir, *run_on_ranks(1, _save_and_forward, workdir, list(MODELS))[0])


@pytest.fixture(scope="module")
def checkpoints(trained):
    """{name: (checkpoint root, our logits [b, s, padded vocab])}."""
    workdir, logits, _ = trained
    return {name: (os.path.join(workdir, name), logits[name]) for name in MODELS}


def _checkpoint_state(root):
    from megatron.core.dist_checkpointing import offline
    from megatron.training.checkpointing import iteration_dir_name, read_tracker

    return offline.read_checkpoint(os.path.join(root, iteration_dir_name(read_tracker(root))))


def _model_tensors(root):
    from megatron.core.dist_checkpointing import offline

    return offline.full_precision_model(_checkpoint_state(root))


@pytest.fixture(scope="module")
def originals(checkpoints):
    """{name: the checkpoint's model tensors by logical name} (tests read them, never change them)."""
    return {name: _model_tensors(root) for name, (root, _) in checkpoints.items()}


@pytest.fixture(scope="module")
def exported(checkpoints, tools, tmp_path_factory):
    """{name: (directory `--to hf` wrote, the HF tensors it returned)}; a test that changes the directory works on
    a copy (`_exported_copy`)."""
    convert_checkpoint, _ = tools
    workdir = tmp_path_factory.mktemp("hf_exported")
    return {name: (str(workdir / name), convert_checkpoint.to_hf(root, str(workdir / name)))
            for name, (root, _) in checkpoints.items()}


def _exported_copy(exported, name, destination):
    shutil.copytree(exported[name][0], destination)
    return destination


LLAMA31_SCALING = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}
EXPECTED_CONFIG = {
    "gpt2": {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": VOCAB, "n_layer": 4,
             "n_embd": 32, "n_head": 4, "n_inner": 128, "activation_function": "gelu", "tie_word_embeddings": True},
    "gpt2_1p_no_bias": {"architectures": ["GPT2LMHeadModel"], "tie_word_embeddings": False},
    "llama_gqa_rope_scaling": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB, "num_key_value_heads": 2,
        "head_dim": 8, "intermediate_size": 64, "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": False, "rope_theta": 1e6, "rope_scaling": LLAMA31_SCALING,
        "rope_parameters": {**LLAMA31_SCALING, "rope_theta": 1e6}},
    "llama_mqa_bias_1p_tied": {"num_key_value_heads": 1, "attention_bias": True, "mlp_bias": True,
                               "tie_word_embeddings": True, "rope_theta": 500.0, "rope_scaling": None,
                               "rope_parameters": {"rope_type": "default", "rope_theta": 500.0}},
    "llama_interleaved_interpolated_qkv_bias": {
        "num_key_value_heads": 2, "attention_bias": True, "mlp_bias": False, "rope_theta": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
    "qwen3_qk_norm_1p_qkv_bias": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 16,
                                  "num_key_value_heads": 2, "attention_bias": True, "use_sliding_window": False},
    "llama_gqa_fp8": {"architectures": ["LlamaForCausalLM"], "num_key_value_heads": 2, "attention_bias": False},
}


@pytest.mark.world_size(1)
@pytest.mark.parametrize("name", list(MODELS))
def test_hf_round_trip_is_bit_exact(name, exported, originals, tools, tmp_path):
    convert_checkpoint, _ = tools
    hf_dir, hf_tensors = exported[name]
    assert sorted(os.listdir(hf_dir)) == ["config.json", "megatron_extras.safetensors", "model.safetensors"]
    with open(os.path.join(hf_dir, "config.json")) as stream:
        config = json.load(stream)
    assert {key: config[key] for key in EXPECTED_CONFIG[name]} == EXPECTED_CONFIG[name]
    embedding = "transformer.wte.weight" if name.startswith("gpt2") else "model.embed_tokens.weight"
    assert hf_tensors[embedding].shape == (VOCAB, 32)  # padding rows stripped
    assert ("lm_head.weight" in hf_tensors) == (not config["tie_word_embeddings"])
    assert not any("fp8" in key for key in hf_tensors)

    original = originals[name]
    histories = [key for key in original if key.endswith(".fp8_amax_history")]
    assert bool(histories) == ("fp8" in name)
    # the layers' amaxes were recorded (the output layer runs outside FP8; its history stays empty)
    assert all(torch.count_nonzero(original[key]) for key in histories if key.startswith("decoder."))
    back = convert_checkpoint.from_hf(hf_dir, str(tmp_path / "back"))
    assert sorted(back) == sorted(original)
    for tensor_name, tensor in original.items():
        assert back[tensor_name].dtype == tensor.dtype and torch.equal(back[tensor_name], tensor), tensor_name
    assert _model_tensors(str(tmp_path / "back")).keys() == original.keys()
    # ... and that checkpoint converts again to the same Hugging Face tensors
    again = convert_checkpoint.to_hf(str(tmp_path / "back"), str(tmp_path / "hf_again"))
    assert sorted(again) == sorted(hf_tensors)
    assert all(torch.equal(again[key], value) for key, value in hf_tensors.items())


@pytest.mark.world_size(1)
@pytest.mark.parametrize("name", FP32_MODELS)
def test_transformers_computes_our_logits(name, checkpoints, trained, exported, originals, tools, tmp_path):
    import transformers  # in the dev extra: a missing install fails here instead of skipping the check
    convert_checkpoint, hf_mapping = tools
    _, ours = checkpoints[name]
    model = transformers.AutoModelForCausalLM.from_pretrained(exported[name][0], dtype=torch.float32)
    model.eval()
    expected_class = {"gpt2": "GPT2LMHeadModel", "qwen3": "Qwen3ForCausalLM"}.get(name.split("_")[0],
                                                                                 "LlamaForCausalLM")
    assert type(model).__name__ == expected_class
    with torch.no_grad():
        theirs = model(_tokens()).logits
    assert theirs.shape == (3, SEQUENCE, VOCAB) and ours.shape == (3, SEQUENCE, PADDED_VOCAB)
    difference = (theirs - ours[..., :VOCAB]).abs().max().item()
    print(f"{name}: max |logit difference| {difference:.3g} (logits up to {ours.abs().max().item():.3g})")
    assert difference <= LOGITS_TOLERANCE
    # The logits of 16 positions hardly feel the slow frequencies: compare those directly.
    our_frequencies = trained[2][name]
    assert (our_frequencies is None) == (expected_class == "GPT2LMHeadModel")
    if our_frequencies is not None:  # HF's linear scaling divides the frequencies where we divide the positions
        interpolation = 2.0 if "interpolated" in name else 1.0
        assert torch.equal(model.model.rotary_emb.inv_freq, our_frequencies / interpolation)
    if "rope_scaling" in name:  # the trained model was scaled: its slowest frequency is divided by the factor 32
        assert our_frequencies[-1].item() == pytest.approx(1e6 ** -0.75 / 32, rel=1e-6)

    # What transformers itself writes (no extras file) imports to the same model over the true vocabulary.
    model.save_pretrained(str(tmp_path / "saved_by_transformers"))
    back = convert_checkpoint.from_hf(str(tmp_path / "saved_by_transformers"), str(tmp_path / "back"),
                                      make_vocab_size_divisible_by=64, apply_layernorm_1p="1p" in name)
    recorded = _checkpoint_state(str(tmp_path / "back"))["common"]["args"]
    scaled = "rope_scaling" in name
    assert (recorded.use_rope_scaling, recorded.rope_scaling_factor) == ((True, 32.0) if scaled else (False, 8.0))
    assert recorded.rotary_seq_len_interpolation_factor == (2.0 if "interpolated" in name else None)
    # attention_bias without mlp_bias: only the QKV bias (HF's zero o_proj bias is dropped)
    assert recorded.add_qkv_bias == ("qkv_bias" in name) and not (recorded.add_qkv_bias and recorded.add_bias_linear)
    original = originals[name]
    if "interleaved" in name:
        # a model from elsewhere rotates halves, as HF's Llama does: its q / k rows come in HF's order
        assert recorded.rotary_interleaved is False
        recorded_shape = hf_mapping.ModelShape.from_args(recorded, VOCAB, PADDED_VOCAB)
        hf_state = model.state_dict()
        for layer, kind in itertools.product(range(4), ("weight", "bias")):
            qkv = f"decoder.layers.{layer}.self_attention.linear_qkv.{kind}"
            assert not torch.equal(back[qkv], original[qkv])
            for projection, rows in zip(("q_proj", "k_proj", "v_proj"), hf_mapping.split_qkv(back[qkv],
                                                                                           recorded_shape)):
                assert torch.equal(rows, hf_state[f"model.layers.{layer}.self_attn.{projection}.{kind}"]), qkv
            back[qkv] = original[qkv]  # (checked above)
    added = set(back) - set(original)  # GPT-2 always has biases: without the extras they come as zero biases
    assert set(original) <= set(back) and all(key.endswith(".bias") and not back[key].any() for key in added)
    assert bool(added) == (name == "gpt2_1p_no_bias")
    for tensor_name, tensor in original.items():
        if tensor_name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            back[tensor_name], tensor = back[tensor_name][:VOCAB], tensor[:VOCAB]
        if "1p" in name and "layernorm.weight" in tensor_name:
            back[tensor_name], tensor = back[tensor_name] + 1, tensor + 1  # gamma is what HF holds
        assert torch.equal(back[tensor_name], tensor), tensor_name


@pytest.mark.world_size(1)
def test_directory_without_extras_imports_with_zero_padding(exported, originals, tools, tmp_path):
    """A model from elsewhere has no megatron_extras.safetensors: the vocabulary is padded with zero rows and a
    zero-centred norm stores gamma - 1, which gives back HF's gamma exactly."""
    convert_checkpoint, _ = tools
    hf_dir = _exported_copy(exported, "llama_mqa_bias_1p_tied", tmp_path / "hf")
    os.remove(hf_dir / "megatron_extras.safetensors")
    original = originals["llama_mqa_bias_1p_tied"]
    back = convert_checkpoint.from_hf(str(hf_dir), str(tmp_path / "back"), make_vocab_size_divisible_by=64,
                                      apply_layernorm_1p=True)
    assert sorted(back) == sorted(original)
    word = back["embedding.word_embeddings.weight"]
    assert word.shape == (PADDED_VOCAB, 32) and torch.count_nonzero(word[VOCAB:]) == 0
    assert torch.equal(word[:VOCAB], original["embedding.word_embeddings.weight"][:VOCAB])
    norm = "decoder.layers.2.input_layernorm.weight"
    assert torch.equal(back[norm] + 1, original[norm] + 1)
    assert not torch.equal(back[norm], original[norm])  # the extras' gamma - 1 is what makes the round trip exact
    for tensor_name, tensor in original.items():
        if "layernorm" not in tensor_name and "embedding" not in tensor_name:
            assert torch.equal(back[tensor_name], tensor), tensor_name


@pytest.mark.world_size(1)
@pytest.mark.parametrize("name, with_extras", [("gpt2", True), ("llama_mqa_bias_1p_tied", False)])
def test_training_loads_the_imported_checkpoint(name, with_extras, checkpoints, exported, tools, tmp_path):
    """What --from hf writes loads into training's model (with or without the extras), and that model computes
    the original logits over the true vocabulary bit for bit (without extras only the padding rows differ)."""
    convert_checkpoint, _ = tools
    _, ours = checkpoints[name]
    hf_dir = exported[name][0]
    if not with_extras:
        hf_dir = _exported_copy(exported, name, tmp_path / "hf")
        os.remove(hf_dir / "megatron_extras.safetensors")
    convert_checkpoint.from_hf(str(hf_dir), str(tmp_path / "back"), make_vocab_size_divisible_by=64,
                               apply_layernorm_1p="1p" in name)
    loaded = run_on_ranks(1, _load_and_forward, name, str(tmp_path / "back"))[0]
    assert torch.equal(loaded[..., :VOCAB], ours[..., :VOCAB])
    assert torch.equal(loaded, ours) == with_extras  # a tied embedding's zero padding rows give other logits


@pytest.mark.world_size(1)
def test_nonzero_bias_into_a_model_without_biases_is_refused(exported, tools, tmp_path):
    convert_checkpoint, _ = tools
    from megatron.core.dist_checkpointing import safetensors_format

    hf_dir = _exported_copy(exported, "gpt2_1p_no_bias", tmp_path / "hf")
    path = str(hf_dir / "model.safetensors")
    tensors, metadata = safetensors_format.load_file(path)
    assert torch.count_nonzero(tensors["transformer.h.1.mlp.c_fc.bias"]) == 0  # written as zeros
    tensors["transformer.h.1.mlp.c_fc.bias"][3] = 0.5
    safetensors_format.save_file(tensors, path, metadata)
    with pytest.raises(SystemExit, match=r"transformer\.h\.1\.mlp\.c_fc\.bias.*--disable-bias-linear"):
        convert_checkpoint.from_hf(str(hf_dir), str(tmp_path / "back"))
    assert not os.path.exists(tmp_path / "back")


@pytest.mark.world_size(1)
def test_config_that_disagrees_with_the_tensors_is_refused(exported, tools, tmp_path):
    convert_checkpoint, _ = tools
    hf_dir = _exported_copy(exported, "llama_gqa_rope_scaling", tmp_path / "hf")
    with open(hf_dir / "config.json") as stream:
        config = json.load(stream)
    with open(hf_dir / "config.json", "w") as stream:
        json.dump({**config, "intermediate_size": 96}, stream)
    with pytest.raises(SystemExit, match=r"'model\.layers\.0\.mlp\.gate_proj\.weight' has shape \(64, 32\), the "
                                         r"model config\.json describes needs \(96, 32\)"):
        convert_checkpoint.from_hf(str(hf_dir), str(tmp_path / "back"))


def _shape(hf_mapping, **flags):
    values = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=4, kv_channels=8,
                  ffn_hidden_size=64, vocab_size=120, padded_vocab_size=128, max_position_embeddings=16)
    return hf_mapping.ModelShape(**{**values, **flags})


def test_models_hugging_face_cannot_compute_are_refused_naming_the_flag(tools):
    _, hf_mapping = tools
    llama = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True)
    assert hf_mapping.architecture_for(_shape(hf_mapping, **llama)) == hf_mapping.LLAMA
    assert hf_mapping.architecture_for(_shape(hf_mapping, **llama, qk_layernorm=True, add_bias_linear=False)) == \
        hf_mapping.QWEN3
    assert hf_mapping.architecture_for(_shape(hf_mapping, squared_relu=True)) == hf_mapping.GPT2
    refusals = {
        "linear biases .*Qwen3, the architecture with query and key norms": _shape(hf_mapping, **llama,
                                                                                   qk_layernorm=True),
        "--rotary-percent 0.5": _shape(hf_mapping, **llama, rotary_percent=0.5),
        "--normalization LayerNorm": _shape(hf_mapping, **{**llama, "normalization": "LayerNorm"}),
        "--squared-relu": _shape(hf_mapping, **{**llama, "swiglu": False}, squared_relu=True),
        "--normalization RMSNorm": _shape(hf_mapping, normalization="RMSNorm"),
        "--swiglu": _shape(hf_mapping, swiglu=True),
        "--num-query-groups 2": _shape(hf_mapping, num_query_groups=2),
        "--kv-channels 16": _shape(hf_mapping, kv_channels=16),
        "--position-embedding-type none: GPT-2 learns absolute positions": _shape(
            hf_mapping, position_embedding_type="none"),
        "--position-embedding-type mrope: GPT-2 learns absolute positions": _shape(
            hf_mapping, position_embedding_type="mrope"),
        "--apply-residual-connection-post-layernorm: GPT-2 and Llama": _shape(
            hf_mapping, apply_residual_connection_post_layernorm=True),
        "LlamaForCausalLM .*--apply-residual-connection-post-layernorm": _shape(
            hf_mapping, **llama, apply_residual_connection_post_layernorm=True),
        "--rotary-seq-len-interpolation-factor 2.0 with --use-rope-scaling": _shape(
            hf_mapping, **llama, use_rope_scaling=True, rotary_seq_len_interpolation_factor=2.0),
        "--openai-gelu: Llama's MLP is SwiGLU": _shape(hf_mapping, **{**llama, "swiglu": False}, openai_gelu=True),
    }
    for flag, shape in refusals.items():
        with pytest.raises(hf_mapping.ConversionError, match=flag):
            hf_mapping.architecture_for(shape)
    # every problem at once
    with pytest.raises(hf_mapping.ConversionError, match="--normalization RMSNorm.*--swiglu.*--qk-layernorm"):
        hf_mapping.architecture_for(_shape(hf_mapping, normalization="RMSNorm", swiglu=True, qk_layernorm=True))
    # refused before any tensor is read, with the MoE and MLA models
    import hf_unsupported

    refusal = hf_unsupported.hf_export_refusal(argparse.Namespace(mtp_num_layers=2))
    assert "--mtp-num-layers 2: multi-token prediction layers" in refusal and "--to torch" in refusal
    assert hf_unsupported.hf_export_refusal(argparse.Namespace(mtp_num_layers=None)) is None
    refusal = hf_unsupported.hf_export_refusal(argparse.Namespace(activation_func_clamp_value=7.0,
                                                                  glu_linear_offset=1.0))
    assert "--activation-func-clamp-value 7.0: a clamped gated MLP" in refusal
    assert "--glu-linear-offset 1.0: act(gate) * (up + offset)" in refusal
    assert hf_unsupported.hf_export_refusal(argparse.Namespace(activation_func_clamp_value=None,
                                                               glu_linear_offset=0.0)) is None
    refusal = hf_unsupported.hf_export_refusal(argparse.Namespace(quick_geglu=True))
    assert "--quick-geglu: a gated MLP with quick GeLU, x * sigmoid(1.702 x), on the gate" in refusal
    assert hf_unsupported.hf_export_refusal(argparse.Namespace(quick_geglu=False)) is None


def test_true_vocab_size_of_a_checkpoint_without_a_recorded_one(tools):
    convert_checkpoint, _ = tools
    null = argparse.Namespace(tokenizer_type="NullTokenizer", vocab_size=120)
    assert convert_checkpoint.true_vocab_size({"args": null}) == 121  # the text ids 0..119 and the eod 120
    assert convert_checkpoint.true_vocab_size({"args": null, "vocab_size": 125}) == 125
    assert convert_checkpoint.true_vocab_size({"args": null}, vocab_size=119) == 119
    byte_level = argparse.Namespace(tokenizer_type="ByteLevelTokenizer", vocab_size=None)
    assert convert_checkpoint.true_vocab_size({"args": byte_level}) == 257


def test_hugging_face_configs_we_cannot_compute_are_refused(tools):
    _, hf_mapping = tools
    gpt2 = {"architectures": ["GPT2LMHeadModel"], "vocab_size": 120, "n_layer": 2, "n_embd": 32, "n_head": 4,
            "n_positions": 16}
    with pytest.raises(hf_mapping.ConversionError, match="activation_function 'quick_gelu' has no counterpart"):
        hf_mapping.shape_from_hf_config({**gpt2, "activation_function": "quick_gelu"}, "DIR", None, 128, False)
    shape, architecture = hf_mapping.shape_from_hf_config({**gpt2, "activation_function": "gelu"}, "DIR", None,
                                                          128, False)
    assert architecture == hf_mapping.GPT2 and shape.ffn_hidden_size == 128 and shape.add_bias_linear
    assert not shape.openai_gelu and not shape.squared_relu
    llama = {"architectures": ["LlamaForCausalLM"], "vocab_size": 120, "hidden_size": 32, "num_hidden_layers": 2,
             "num_attention_heads": 4, "intermediate_size": 64, "max_position_embeddings": 16}
    refusals = {"rope_scaling": {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
                "hidden_act 'gelu'": {"hidden_act": "gelu"},
                "mlp_bias true with attention_bias false": {"mlp_bias": True},
                "'linear' with factor -2: it must be a positive number": {"rope_scaling": {"type": "linear",
                                                                                           "factor": -2}},
                "partial_rotary_factor": {"partial_rotary_factor": 0.5}, "GemmaForCausalLM":
                {"architectures": ["GemmaForCausalLM"], "model_type": "gemma"}}
    for message, change in refusals.items():
        with pytest.raises(hf_mapping.ConversionError, match=message):
            hf_mapping.shape_from_hf_config({**llama, **change}, "DIR", None, 128, False)


def test_llama3_rope_scaling_both_ways(tools):
    """--use-rope-scaling is config.json's llama3 rope_scaling with the values our rotary embedding fixes; a Llama
    3.1 / 3.2 config.json (transformers 4's rope_scaling, or 5's rope_parameters) reads back as the flags, and
    other llama3 values are refused naming them."""
    _, hf_mapping = tools
    llama = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, rotary_base=500000.0)
    shape = _shape(hf_mapping, **llama, use_rope_scaling=True, rope_scaling_factor=32.0)
    config = hf_mapping.hf_config(shape, hf_mapping.architecture_for(shape))
    llama32_scaling = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192}
    assert config["rope_scaling"] == llama32_scaling and config["rope_theta"] == 500000.0
    assert config["rope_parameters"] == {**llama32_scaling, "rope_theta": 500000.0}
    assert hf_mapping.shape_from_hf_config(config, "DIR", None, 128, False) == (shape, hf_mapping.LLAMA)
    plain = _shape(hf_mapping, **llama)
    assert hf_mapping.hf_config(plain, hf_mapping.LLAMA)["rope_scaling"] is None
    assert hf_mapping.shape_from_hf_config(hf_mapping.hf_config(plain, hf_mapping.LLAMA), "DIR", None, 128,
                                           False)[0] == plain

    published = {key: value for key, value in config.items() if key != "rope_parameters"}
    llama31 = {**published, "rope_scaling": {**llama32_scaling, "factor": 8.0}}  # as Llama 3.1's config.json
    read = hf_mapping.shape_from_hf_config(llama31, "DIR", None, 128, False)[0]
    assert (read.use_rope_scaling, read.rope_scaling_factor, read.rotary_base) == (True, 8.0, 500000.0)
    newer = {**published, "rope_scaling": None, "rope_parameters": {**llama32_scaling, "rope_theta": 250000.0}}
    read = hf_mapping.shape_from_hf_config(newer, "DIR", None, 128, False)[0]
    assert (read.use_rope_scaling, read.rope_scaling_factor, read.rotary_base) == (True, 32.0, 250000.0)

    fixed = "fixes low_freq_factor 1.0, high_freq_factor 4.0, original_max_position_embeddings 8192"
    refusals = {r"'llama3' with low_freq_factor 2.0: our rotary embedding \(--use-rope-scaling\) " + fixed:
                {"low_freq_factor": 2.0}, "'llama3' with high_freq_factor 8.0": {"high_freq_factor": 8.0},
                "'llama3' with original_max_position_embeddings 4096": {"original_max_position_embeddings": 4096},
                "'llama3' with factor 0: it must be a positive number": {"factor": 0},
                r"'dynamic' \(config.json rope_scaling / rope_parameters\) has no counterpart":
                    {"rope_type": "dynamic"}}
    for message, change in refusals.items():
        with pytest.raises(hf_mapping.ConversionError, match=f"^DIR: RoPE scaling {message}"):
            hf_mapping.shape_from_hf_config({**published, "rope_scaling": {**llama32_scaling, **change}}, "DIR",
                                            None, 128, False)
    without = {key: value for key, value in llama32_scaling.items() if key != "high_freq_factor"}
    with pytest.raises(hf_mapping.ConversionError, match="^DIR: RoPE scaling 'llama3' .* without 'high_freq_factor'"):
        hf_mapping.shape_from_hf_config({**published, "rope_scaling": without}, "DIR", None, 128, False)


def test_export_of_a_checkpoint_older_than_the_rope_scaling_flags(tools):
    """Arguments saved before --use-rope-scaling existed describe a model without it."""
    import dataclasses

    _, hf_mapping = tools
    shape = _shape(hf_mapping, position_embedding_type="rope", normalization="RMSNorm", swiglu=True)
    older = {key: value for key, value in dataclasses.asdict(shape).items()
             if key not in ("use_rope_scaling", "rope_scaling_factor", "vocab_size", "padded_vocab_size")}
    assert hf_mapping.ModelShape.from_args(argparse.Namespace(**older), 120, 128) == shape
    with pytest.raises(hf_mapping.ConversionError, match="lack 'rotary_base'"):
        hf_mapping.ModelShape.from_args(argparse.Namespace(**{k: v for k, v in older.items() if k != "rotary_base"}),
                                        120, 128)


@pytest.mark.parametrize("factor", [8.0, 32.0])
def test_transformers_llama3_frequencies_equal_ours(tools, factor):
    """transformers' llama3 frequencies (what its LlamaRotaryEmbedding holds; the exported model's own is checked in
    test_transformers_computes_our_logits) for the config.json we write are ours (Llama 3.1's heads: 128 channels,
    base 500000, so many frequencies fall in each band)."""
    import transformers  # in the dev extra
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    _, hf_mapping = tools
    shape = _shape(hf_mapping, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                   hidden_size=512, kv_channels=128, rotary_base=500000.0, use_rope_scaling=True,
                   rope_scaling_factor=factor)
    config = transformers.LlamaConfig.from_dict(hf_mapping.hf_config(shape, hf_mapping.LLAMA))
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    ours = RotaryEmbedding(128, rotary_base=500000.0, rope_scaling=True, rope_scaling_factor=factor)
    plain = RotaryEmbedding(128, rotary_base=500000.0).inverse_frequencies("cpu")
    assert torch.equal(theirs, ours.inverse_frequencies("cpu"))
    wavelengths = 2 * torch.pi / plain
    kept, divided = wavelengths < 2048, wavelengths > 8192
    assert kept.sum() and divided.sum() and (~kept & ~divided).sum()  # every band is there
    assert torch.equal(theirs[kept], plain[kept]) and torch.equal(theirs[divided], plain[divided] / factor)


def test_gpt2_activations_are_transformers_own(tools):
    """Each activation_function we write or read is, in transformers, the function our MLP computes: --openai-gelu
    is written as 'gelu_pytorch_tanh' (the same torch op); GPT-2's default 'gelu_new' spells out the same formula."""
    from transformers.activations import ACT2FN

    from megatron.core.activations import squared_relu
    from megatron.core.transformer.utils import openai_gelu

    _, hf_mapping = tools
    x = torch.linspace(-6, 6, 4001)
    ours = {"gelu": torch.nn.functional.gelu(x), "relu2": squared_relu(x), "gelu_pytorch_tanh": openai_gelu(x),
            "gelu_new": openai_gelu(x)}
    assert sorted(ours) == sorted(hf_mapping.GPT2_ACTIVATIONS)
    for name, expected in ours.items():
        assert torch.allclose(ACT2FN[name](x), expected, rtol=0, atol=1e-6 if name == "gelu_new" else 0), name
    tanh_gelu = _shape(hf_mapping, openai_gelu=True)
    config = hf_mapping.hf_config(tanh_gelu, hf_mapping.architecture_for(tanh_gelu))
    assert config["activation_function"] == "gelu_pytorch_tanh"
    shape, _ = hf_mapping.shape_from_hf_config(config, "DIR", None, 128, False)
    assert shape.openai_gelu and not shape.squared_relu
    shape, _ = hf_mapping.shape_from_hf_config({key: value for key, value in config.items()
                                                if key != "activation_function"}, "DIR", None, 128, False)
    assert shape.openai_gelu  # GPT-2's default, gelu_new
    assert hf_mapping.hf_config(_shape(hf_mapping, squared_relu=True), hf_mapping.GPT2)["activation_function"] == \
        "relu2"


def test_position_interpolation_is_linear_rope_scaling(tools):
    """--rotary-seq-len-interpolation-factor divides the positions; transformers' 'linear' RoPE divides the
    frequencies by its factor: the same angles. Both rope_scaling spellings read back as the flag."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    _, hf_mapping = tools
    shape = _shape(hf_mapping, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                   rotary_seq_len_interpolation_factor=4.0)
    config = hf_mapping.hf_config(shape, hf_mapping.architecture_for(shape))
    assert config["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
    theirs, _ = ROPE_INIT_FUNCTIONS["linear"](transformers.LlamaConfig.from_dict(config), "cpu")
    positions = torch.arange(64.0)
    ours = RotaryEmbedding(8, seq_len_interpolation_factor=4.0)(64)[:, 0, 0, :4]
    assert torch.allclose(torch.outer(positions, theirs), ours, rtol=1e-6, atol=0)
    assert torch.equal(ours[4], RotaryEmbedding(8)(2)[1, 0, 0, :4])  # position 4 turns as far as 1 did
    assert hf_mapping.shape_from_hf_config(config, "DIR", None, 128, False) == (shape, hf_mapping.LLAMA)
    older = {**config, "rope_parameters": None, "rope_scaling": {"type": "linear", "factor": 4}}  # transformers 4
    assert hf_mapping.shape_from_hf_config(older, "DIR", None, 128, False)[0] == shape


@pytest.mark.world_size(1)
def test_qkv_bias_alone(tools, exported, tmp_path):
    """--disable-bias-linear --add-qkv-bias: GPT-2's c_attn gets the bias, its other linears zero biases; Llama's
    attention_bias gives o_proj a bias that must stay zero (the Llama model is checked end to end above)."""
    convert_checkpoint, hf_mapping = tools
    shape = _shape(hf_mapping, num_layers=1, add_bias_linear=False, add_qkv_bias=True)
    generator = torch.Generator().manual_seed(3)
    sizes = {"embedding.word_embeddings.weight": (128, 32), "embedding.position_embeddings.weight": (16, 32),
             "decoder.layers.0.self_attention.linear_qkv.weight": (96, 32),
             "decoder.layers.0.self_attention.linear_qkv.bias": (96,),
             "decoder.layers.0.self_attention.linear_proj.weight": (32, 32),
             "decoder.layers.0.mlp.linear_fc1.weight": (64, 32), "decoder.layers.0.mlp.linear_fc2.weight": (32, 64)}
    for norm in ("decoder.layers.0.input_layernorm", "decoder.layers.0.pre_mlp_layernorm", "decoder.final_layernorm"):
        sizes.update({f"{norm}.weight": (32,), f"{norm}.bias": (32,)})
    model = {name: torch.randn(size, generator=generator) for name, size in sizes.items()}
    hf, extras = hf_mapping.to_hf_tensors(model, shape, hf_mapping.GPT2)
    qkv_bias = model["decoder.layers.0.self_attention.linear_qkv.bias"].reshape(4, 3, 8)  # [head, q|k|v, channel]
    assert torch.equal(hf["transformer.h.0.attn.c_attn.bias"], qkv_bias.transpose(0, 1).flatten())
    for zero in ("attn.c_proj.bias", "mlp.c_fc.bias", "mlp.c_proj.bias"):
        assert not hf[f"transformer.h.0.{zero}"].any(), zero
    back = hf_mapping.from_hf_tensors(hf, extras, shape, hf_mapping.GPT2, "DIR")
    assert sorted(back) == sorted(model) and all(torch.equal(back[name], model[name]) for name in model)

    hf_dir = _exported_copy(exported, "llama_interleaved_interpolated_qkv_bias", tmp_path / "hf")
    from megatron.core.dist_checkpointing import safetensors_format

    path = str(hf_dir / "model.safetensors")
    tensors, metadata = safetensors_format.load_file(path)
    assert not tensors["model.layers.2.self_attn.o_proj.bias"].any()
    tensors["model.layers.2.self_attn.o_proj.bias"][5] = 0.25
    safetensors_format.save_file(tensors, path, metadata)
    with pytest.raises(SystemExit, match=r"'model\.layers\.2\.self_attn\.o_proj\.bias' is not zero, but "
                                         "config.json's attention_bias without mlp_bias reads as "
                                         "--disable-bias-linear --add-qkv-bias"):
        convert_checkpoint.from_hf(str(hf_dir), str(tmp_path / "back"))


def test_qkv_and_swiglu_layouts(tools):
    """Query head g * m + j is group g's j-th; k and v follow each group's queries; gate/up rows alternate."""
    _, hf_mapping = tools
    shape = _shape(hf_mapping, num_attention_heads=4, num_query_groups=2, kv_channels=1, hidden_size=4)
    fused = torch.arange(8.0)  # rows: [q0 q1 k0 v0 | q2 q3 k1 v1] with one channel per head
    query, key, value = hf_mapping.split_qkv(fused, shape)
    assert query.tolist() == [0, 1, 4, 5] and key.tolist() == [2, 6] and value.tolist() == [3, 7]
    assert torch.equal(hf_mapping.fuse_qkv(query, key, value, shape), fused)
    gate, up = hf_mapping.split_gate_up(torch.arange(6.0).reshape(6, 1))
    assert gate.flatten().tolist() == [0, 2, 4] and up.flatten().tolist() == [1, 3, 5]
    assert torch.equal(hf_mapping.fuse_gate_up(gate, up).flatten(), torch.arange(6.0))


@pytest.mark.world_size(1)
def test_cli_round_trip(checkpoints, originals, tools, tmp_path, monkeypatch):
    """The command line writes and reads the same directory the functions do: `--to hf` as a script in a fresh
    process, `--from hf` through the same `main()` in this one."""
    import subprocess

    convert_checkpoint, _ = tools
    root, _ = checkpoints["gpt2"]
    script = os.path.join(TOOLS, "convert_checkpoint.py")
    result = subprocess.run([sys.executable, script, "--to", "hf", "--input", root, "--output", str(tmp_path / "hf")],
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    monkeypatch.setattr(sys, "argv", [script, "--from", "hf", "--input", str(tmp_path / "hf"), "--output",
                                      str(tmp_path / "back")])
    convert_checkpoint.main()
    original, back = originals["gpt2"], _model_tensors(str(tmp_path / "back"))
    assert sorted(back) == sorted(original) and all(torch.equal(back[k], v) for k, v in original.items())
