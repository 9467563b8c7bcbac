"""tools/checkpoint/convert.py: upstream's --loader / --saver command line on this repository's converters.

A Hugging Face Llama directory (written here tensor by tensor, head_dim wider than hidden / heads, grouped-query
attention) imports through --loader llama_mistral to what `convert_checkpoint.py --from hf` writes and exports
through --saver hf to the same tensors; a checkpoint of a data-parallel run (torch_dist and --ckpt-format torch)
converted with --target-tensor-parallel-size 2 loads at TP 2 with every tensor equal; bad flags are named.
"""

import json
import os
import sys

import pytest
import torch

from tests.unit_tests.dist_checkpointing.pretrain_helpers import TrainingState
from tests.unit_tests.multiprocess_harness import run_on_ranks

TOOLS = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", "tools", "checkpoint"))
VOCAB, HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 50, 32, 48, 2, 4, 2, 16
HF_TO_CORE = ["--model-type", "GPT", "--loader", "llama_mistral", "--checkpoint-type", "hf", "--model-size", "llama3",
              "--bf16", "--saver", "core", "--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "1"]


@pytest.fixture(scope="module")
def tools():
    sys.path.insert(0, TOOLS)
    import convert
    import convert_checkpoint

    yield convert, convert_checkpoint
    sys.path.remove(TOOLS)


def _write_hf_llama(directory):
    """config.json and model.safetensors of a LlamaForCausalLM with random weights; returns its tensors."""
    from megatron.core.dist_checkpointing import safetensors_format

    generator = torch.Generator().manual_seed(3)
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,),
              "lm_head.weight": (VOCAB, HIDDEN)}
    for layer in range(LAYERS):
        prefix = f"model.layers.{layer}."
        shapes.update({
            f"{prefix}self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
            f"{prefix}self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            f"{prefix}self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            f"{prefix}self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
            f"{prefix}mlp.gate_proj.weight": (FFN, HIDDEN), f"{prefix}mlp.up_proj.weight": (FFN, HIDDEN),
            f"{prefix}mlp.down_proj.weight": (HIDDEN, FFN),
            f"{prefix}input_layernorm.weight": (HIDDEN,), f"{prefix}post_attention_layernorm.weight": (HIDDEN,)})
    tensors = {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
              "hidden_size": HIDDEN, "intermediate_size": FFN, "num_hidden_layers": LAYERS,
              "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
              "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "hidden_act": "silu", "attention_bias": False,
              "mlp_bias": False, "tie_word_embeddings": False, "dtype": "float32",
              "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}}
    os.makedirs(directory)
    with open(os.path.join(directory, "config.json"), "w") as stream:
        json.dump(config, stream)
    safetensors_format.save_file(tensors, os.path.join(directory, "model.safetensors"), {"format": "pt"})
    return tensors


def _read(root):
    from megatron.core.dist_checkpointing import offline
    from megatron.training.checkpointing import iteration_dir_name, read_tracker

    return offline.read_checkpoint(os.path.join(root, iteration_dir_name(read_tracker(root))))


def _model(state):
    return {key: value for key, value in state.items() if key.startswith("model.")}


def _assert_same_tensors(actual, expected):
    assert sorted(actual) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(actual[name], tensor), name


def test_hf_to_core_and_back_as_convert_checkpoint_does(tools, tmp_path, capsys):
    from megatron.core.dist_checkpointing import safetensors_format

    convert, convert_checkpoint = tools
    hf_dir = str(tmp_path / "hf")
    original = _write_hf_llama(hf_dir)
    convert.main([*HF_TO_CORE, "--load-dir", hf_dir, "--save-dir", str(tmp_path / "core"), "--true-vocab-size",
                  "40", "--megatron-path", "/opt/Megatron-LM"])
    printed = capsys.readouterr().out
    convert_checkpoint.main(["--from", "hf", "--input", hf_dir, "--output", str(tmp_path / "reference")])
    ours, reference = _read(str(tmp_path / "core")), _read(str(tmp_path / "reference"))
    _assert_same_tensors(_model(ours), _model(reference))
    assert ours["model.embedding.word_embeddings.weight"].shape == (128, HIDDEN)  # padded as --from hf pads
    assert vars(ours["common"]["args"]) == vars(reference["common"]["args"])
    assert ours["common"]["args"].kv_channels == HEAD_DIM and ours["common"]["args"].num_query_groups == KV_HEADS
    assert ours["common"]["vocab_size"] == 40 and reference["common"]["vocab_size"] == VOCAB  # --true-vocab-size
    assert "note: --megatron-path /opt/Megatron-LM: ignored" in printed
    assert f"pretrain_gpt.py --load {tmp_path / 'core'} --finetune --tensor-model-parallel-size 2 " \
           "--pipeline-model-parallel-size 1 " in printed
    assert "--ckpt-convert-format torch --ckpt-convert-save TORCH_DIR" in printed and "train with --bf16" in printed

    # --saver hf writes what --to hf writes: the original tensors, in a directory that imports again.
    convert.main(["--model-type", "GPT", "--loader", "core", "--saver", "hf", "--load-dir", str(tmp_path / "core"),
                  "--save-dir", str(tmp_path / "hf_back")])
    back, _ = safetensors_format.load_file(str(tmp_path / "hf_back" / "model.safetensors"))
    _assert_same_tensors(back, original)
    capsys.readouterr()
    convert.main([*HF_TO_CORE, "--load-dir", str(tmp_path / "hf_back"), "--save-dir", str(tmp_path / "again"),
                  "--model-size", "mistral"])
    assert f"note: --model-size mistral names a MistralForCausalLM; {tmp_path / 'hf_back' / 'config.json'} is a " \
           "LlamaForCausalLM, converted as it says" in capsys.readouterr().out
    _assert_same_tensors(_model(_read(str(tmp_path / "again"))), _model(reference))
    assert sorted(os.listdir(tmp_path)) == ["again", "core", "hf", "hf_back", "reference"]  # no scratch left


def _save_and_load_at_tp2(workdir):
    """On two ranks: a TP 1 (data-parallel 2) run saves torch_dist and --ckpt-format torch; rank 0 converts each
    with convert.py --target-tensor-parallel-size 2; a TP 2 model loads the first and saves it again."""
    from megatron.training import checkpointing

    sys.path.insert(0, TOOLS)
    import convert

    state = TrainingState("--ckpt-format torch")
    try:
        state.train_steps(1)
        state.args.save = os.path.join(workdir, "legacy")
        checkpointing.save_checkpoint(1, state.model, state.optimizer, state.scheduler, state.args)
        state.args.ckpt_format, state.args.save = "torch_dist", os.path.join(workdir, "dist")
        checkpointing.save_checkpoint(1, state.model, state.optimizer, state.scheduler, state.args)
    finally:
        state.close()
    if torch.distributed.get_rank() == 0:
        for loader, source in (("core", "dist"), ("legacy", "legacy")):
            convert.main(["--model-type", "GPT", "--loader", loader, "--saver", "core", "--load-dir",
                          os.path.join(workdir, source), "--save-dir", os.path.join(workdir, f"{source}_tp2"),
                          "--target-tensor-parallel-size", "2", "--saver-transformer-impl", "local"])
    torch.distributed.barrier()
    state = TrainingState(f"--tensor-model-parallel-size 2 --load {os.path.join(workdir, 'dist_tp2')}")
    try:
        iteration = checkpointing.load_checkpoint(state.model, state.optimizer, state.scheduler, state.args)
        local_fc1 = tuple(state.model[0].module.decoder.layers[0].mlp.linear_fc1.weight.shape)
        state.args.save = os.path.join(workdir, "reloaded")
        checkpointing.save_checkpoint(iteration, state.model, state.optimizer, state.scheduler, state.args)
    finally:
        state.close()
    return iteration, local_fc1


@pytest.mark.world_size(2)
def test_core_to_core_at_target_tp2_loads_with_equal_weights(tools, tmp_path, capsys):
    iteration, local_fc1 = run_on_ranks(2, _save_and_load_at_tp2, str(tmp_path))[0]
    dist = _read(str(tmp_path / "dist"))
    assert iteration == 1 and local_fc1 == (64, 32)  # each TP rank holds half of SwiGLU fc1's 128 rows
    reloaded = _read(str(tmp_path / "reloaded"))
    assert reloaded["common"]["layout"]["tensor_model_parallel_size"] == 2
    for name in ("dist_tp2", "legacy_tp2"):
        converted = _read(str(tmp_path / name))
        assert converted["common"]["iteration"] == 1
        tensors = {key: value for key, value in converted.items() if torch.is_tensor(value)}
        _assert_same_tensors(tensors, {key: value for key, value in dist.items() if torch.is_tensor(value)})
    # What TP 2 loaded from the conversion and saved again: the input's weights and optimizer state.
    _assert_same_tensors({key: value for key, value in reloaded.items() if torch.is_tensor(value)},
                         {key: value for key, value in dist.items() if torch.is_tensor(value)})


def _pretrain_without_records(argv):
    """pretrain() with TINY_GPT + `argv` that trains no iteration (a --ckpt-convert-format launch)."""
    import pretrain_gpt
    from megatron.core.enums import ModelType
    from megatron.training.training import pretrain
    from tests.unit_tests.dist_checkpointing.pretrain_helpers import tiny_gpt_argv

    pretrain(pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider,
             ModelType.encoder_or_decoder, pretrain_gpt.forward_step, argv=tiny_gpt_argv(argv).split())


def _torch_format_at_tp2_as_printed(workdir):
    """A TP 1 run (DP 2) saves --ckpt-format torch at iteration 2 of 4; convert.py converts it for TP 2; the
    torch-format launch it prints writes TORCH_DIR/torch at TP 2, from which a TP 2 run trains iterations 3 and 4.
    Returns (the straight run's losses, the resumed run's, what convert.py printed)."""
    import contextlib
    import io

    from megatron.training.checkpointing import write_tracker
    from tests.unit_tests.dist_checkpointing.pretrain_helpers import run_pretrain

    sys.path.insert(0, TOOLS)
    import convert

    # 121 tokens padded to multiples of 128 x TP: 128 rows at TP 1, which TP 2 would pad to 256
    flags = "--make-vocab-size-divisible-by 128 --train-iters 4 --lr-decay-iters 4"
    legacy, dist_tp2, torch_tp2 = (os.path.join(workdir, name) for name in ("legacy", "dist_tp2", "torch_tp2"))
    straight = run_pretrain(workdir, f"{flags} --micro-batch-size 4 --ckpt-format torch --save {legacy} "
                                     "--save-interval 2")
    printed = io.StringIO()
    if torch.distributed.get_rank() == 0:
        write_tracker(legacy, 2)
        with contextlib.redirect_stdout(printed):
            convert.main(["--model-type", "GPT", "--loader", "core", "--saver", "core", "--load-dir", legacy,
                          "--save-dir", dist_tp2, "--target-tensor-parallel-size", "2"])
    torch.distributed.barrier()
    tp2 = f"{flags} --micro-batch-size 8 --use-checkpoint-opt_param-scheduler"
    _pretrain_without_records(f"{tp2} --load {dist_tp2} --use-checkpoint-args --tensor-model-parallel-size 2 "
                              f"--pipeline-model-parallel-size 1 --ckpt-convert-format torch --ckpt-convert-save "
                              f"{torch_tp2}")
    resumed = run_pretrain(workdir, f"{tp2} --ckpt-format torch --load {torch_tp2}/torch --use-checkpoint-args "
                                    "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 1")
    return straight, resumed, printed.getvalue()


@pytest.mark.world_size(2)
def test_torch_format_at_target_tp2_trains_on_from_the_same_loss(tools, tmp_path):
    """convert.py writes torch_dist and prints the launch that writes the torch format at the target layout; the
    round trip TP 1 -> TP 2 keeps the model, padded vocabulary included: the first loss after the load (and the
    next) equal the uninterrupted TP 1 run's, to the reduction order of another TP size."""
    straight, resumed, printed = run_on_ranks(2, _torch_format_at_tp2_as_printed, str(tmp_path))[0]
    assert (f"torchrun --nproc-per-node 2 pretrain_gpt.py --load {tmp_path / 'dist_tp2'} --use-checkpoint-args "
            "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 --ckpt-convert-format torch "
            "--ckpt-convert-save TORCH_DIR") in printed
    assert ("which writes TORCH_DIR/torch; train from it with --ckpt-format torch --load TORCH_DIR/torch "
            "--use-checkpoint-args --tensor-model-parallel-size 2 --pipeline-model-parallel-size 1") in printed
    assert sorted(resumed) == [3, 4]
    for iteration, loss in resumed.items():
        assert loss == pytest.approx(straight[iteration], rel=1e-6), (iteration, straight, resumed)
    assert os.listdir(tmp_path / "torch_tp2") == ["torch"]
    assert sorted(os.listdir(tmp_path / "torch_tp2" / "torch" / "iter_0000002")) == ["mp_rank_00", "mp_rank_01"]


@pytest.mark.parametrize("argv, group", [
    (["--help"], "--loader megatron"),  # upstream's default plugins, which are not here: the common flags
    (["--loader", "llama_mistral", "--saver", "core", "-h"], "--target-tensor-parallel-size"),
])
def test_help_prints_the_flags_and_exits_zero(tools, capsys, argv, group):
    convert, _ = tools
    with pytest.raises(SystemExit) as exit_info:
        convert.parse_args(argv)
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    assert "--load-dir LOAD_DIR" in printed and "One of core, mcore, legacy, megatron, llama_mistral." in printed
    assert group in printed


@pytest.mark.parametrize("argv, message", [
    (["--model-type", "BERT"], "--model-type BERT: only GPT models convert here; choose GPT"),
    (["--loader", "mixtral_hf"], "--loader mixtral_hf: import the Mixtral directory with "
                                 "tools/checkpoint/convert_checkpoint.py --from hf"),
    (["--loader", "foo"], "--loader foo: not a plugin here; choose one of core, mcore, legacy, megatron, "
                          "llama_mistral"),
    (["--saver", "bar"], "--saver bar: not a plugin here; choose one of core, mcore, hf"),
    (["--saver", "legacy"], "--saver legacy: upstream's legacy saver writes --ckpt-format torch at one layout; use "
                            "--saver core"),
    (["--loader", "llama_mistral", "--checkpoint-type", "meta"], "--checkpoint-type meta: Meta's consolidated"),
    (["--loader", "llama_mistral"], "the following arguments are required: --checkpoint-type"),
    (["--loader", "llama_mistral", "--checkpoint-type", "hf", "--bf16", "--fp16"], "--bf16 and --fp16: pass one"),
    (["--target-tensor-parallel-size", "0"], "--target-tensor-parallel-size 0: must be at least 1"),
])
def test_bad_flags_are_named(tools, tmp_path, capsys, argv, message):
    convert, _ = tools
    defaults = {"--model-type": "GPT", "--loader": "core", "--saver": "core"}
    for flag, value in defaults.items():
        if flag not in argv:
            argv = [*argv, flag, value]
    with pytest.raises(SystemExit) as exit_info:
        convert.main([*argv, "--load-dir", str(tmp_path / "in"), "--save-dir", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert f"error: {message}" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "out")


def test_a_saver_left_to_upstreams_default_is_named_as_not_given(tools, tmp_path, capsys):
    convert, _ = tools
    with pytest.raises(SystemExit) as exit_info:
        convert.main(["--model-type", "GPT", "--loader", "core", "--load-dir", str(tmp_path / "in"),
                      "--save-dir", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "error: --saver not given (upstream's default: megatron): upstream's default saver;" in error
    assert "choose one of core, mcore, hf" in error


def test_inputs_and_target_sizes_the_model_cannot_take_are_named(tools, tmp_path):
    convert, convert_checkpoint = tools
    hf_dir = str(tmp_path / "hf")
    _write_hf_llama(hf_dir)
    convert_checkpoint.from_hf(hf_dir, str(tmp_path / "core"))
    core_to_core = ["--model-type", "GPT", "--loader", "core", "--saver", "core", "--load-dir"]
    for argv, message in [
        ([str(tmp_path / "core"), "--target-tensor-parallel-size", "4"],
         "--target-tensor-parallel-size 4: the model's 2 key/value heads (--num-query-groups) do not split evenly"),
        ([str(tmp_path / "core"), "--target-pipeline-parallel-size", "3"],
         "--target-pipeline-parallel-size 3: more stages than the model's 2 layers"),
        ([str(tmp_path / "core"), "--target-expert-parallel-size", "2"],
         "--target-expert-parallel-size 2: the model has no experts (--num-experts)"),
        ([hf_dir], f"--load-dir {hf_dir}: a Hugging Face model directory; read it with --loader llama_mistral "
                   "--checkpoint-type hf"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            convert.main([*core_to_core, *argv, "--save-dir", str(tmp_path / "out")])
        assert str(exit_info.value.code).startswith(message), exit_info.value.code
    with pytest.raises(SystemExit) as exit_info:
        convert.main([*HF_TO_CORE, "--load-dir", str(tmp_path / "core"), "--save-dir", str(tmp_path / "out")])
    assert str(exit_info.value.code).startswith(f"--load-dir {tmp_path / 'core'}: no config.json")
    assert not os.path.exists(tmp_path / "out")


def test_upstream_loader_flags_vocab_file_and_position_embedding_type(tools, tmp_path, capsys):
    """--vocab-file gives the vocabulary size as --true-vocab-size does (upstream: the entries of its vocab.json),
    for the core and the llama_mistral loader; --position-embedding-type is checked against the checkpoint's."""
    from megatron.core.dist_checkpointing import safetensors_format

    convert, convert_checkpoint = tools
    hf_dir, core = str(tmp_path / "hf"), str(tmp_path / "core")
    original = _write_hf_llama(hf_dir)
    convert_checkpoint.from_hf(hf_dir, core)
    vocab_file = tmp_path / "vocab.json"
    vocab_file.write_text(json.dumps({f"token{i}": i for i in range(40)}))
    core_to_hf = ["--model-type", "GPT", "--loader", "core", "--saver", "hf", "--load-dir", core]
    convert.main([*core_to_hf, "--save-dir", str(tmp_path / "by_file"), "--vocab-file", str(vocab_file),
                  "--position-embedding-type", "rope"])
    convert.main([*core_to_hf, "--save-dir", str(tmp_path / "by_size"), "--true-vocab-size", "40"])
    for name in ("by_file", "by_size"):
        with open(tmp_path / name / "config.json") as stream:
            assert json.load(stream)["vocab_size"] == 40
        exported, _ = safetensors_format.load_file(str(tmp_path / name / "model.safetensors"))
        assert torch.equal(exported["model.embed_tokens.weight"], original["model.embed_tokens.weight"][:40])
    convert.main([*HF_TO_CORE, "--load-dir", hf_dir, "--save-dir", str(tmp_path / "imported"), "--vocab-file",
                  str(vocab_file)])
    assert _read(str(tmp_path / "imported"))["common"]["vocab_size"] == 40
    capsys.readouterr()

    # A checkpoint that records no vocabulary size (upstream's) and whose tokenizer file is gone: the error names
    # this tool's flags, and --vocab-file exports it.
    from megatron.core.dist_checkpointing import offline

    state = _read(core)
    for key in ("vocab_size", convert_checkpoint.HF_SOURCE_KEY):
        state["common"].pop(key, None)
    args = state["common"]["args"]
    args.tokenizer_type, args.vocab_file, args.merge_file = "GPT2BPETokenizer", str(tmp_path / "gone.json"), None
    offline.write_checkpoint(str(tmp_path / "unrecorded"), 1, state, {})
    unrecorded_to_hf = [*core_to_hf[:-1], str(tmp_path / "unrecorded"), "--save-dir", str(tmp_path / "from_file")]
    with pytest.raises(SystemExit) as exit_info:
        convert.main(unrecorded_to_hf)
    assert str(exit_info.value.code).startswith("cannot rebuild the checkpoint's GPT2BPETokenizer tokenizer")
    assert str(exit_info.value.code).endswith("; pass --true-vocab-size N or --vocab-file VOCAB_JSON")
    convert.main([*unrecorded_to_hf, "--vocab-file", str(vocab_file)])
    with open(tmp_path / "from_file" / "config.json") as stream:
        assert json.load(stream)["vocab_size"] == 40

    with pytest.raises(SystemExit) as exit_info:
        convert.main([*core_to_hf, "--save-dir", str(tmp_path / "out"), "--position-embedding-type",
                      "learned_absolute"])
    assert exit_info.value.code == (f"--position-embedding-type learned_absolute: the checkpoint at {core} was "
                                    "trained with --position-embedding-type rope, which the conversion keeps; drop "
                                    f"the flag or pass rope; nothing was written to {tmp_path / 'out'}")
    (tmp_path / "merges.txt").write_text("#version: 0.2\na b\n")
    for extra, message in [
        (["--vocab-file", str(vocab_file), "--true-vocab-size", "50"],
         f"--true-vocab-size 50 and --vocab-file {vocab_file} (40 tokens) disagree; pass one"),
        (["--vocab-file", str(tmp_path / "merges.txt")],
         f"--vocab-file {tmp_path / 'merges.txt'}: cannot read it as a JSON vocabulary"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            convert.main([*core_to_hf, "--save-dir", str(tmp_path / "out"), *extra])
        assert exit_info.value.code == 2
        assert f"error: {message}" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "out")


def _write_legacy_checkpoint(root):
    """A --ckpt-format torch checkpoint at TP 1 (one mp_rank_00 file) of a model with 2 key/value heads."""
    import argparse

    rank_dir = os.path.join(root, "iter_0000001", "mp_rank_00")
    os.makedirs(rank_dir)
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as stream:
        stream.write("1")
    args = argparse.Namespace(num_layers=LAYERS, num_attention_heads=HEADS, group_query_attention=True,
                              num_query_groups=KV_HEADS)
    model = {"decoder.layers.0.self_attention.linear_qkv.weight": torch.zeros(HEADS * HEAD_DIM, HIDDEN)}
    torch.save({"model": model, "args": args, "iteration": 1}, os.path.join(rank_dir, "model_optim_rng.pt"))


def test_target_sizes_are_checked_before_anything_is_written(tools, tmp_path, capsys):
    """The llama_mistral and legacy loaders write the conversion into --save-dir: a target size the model cannot
    take is refused from config.json or the saved arguments first, and --save-dir stays unwritten."""
    convert, _ = tools
    hf_dir, legacy_dir = str(tmp_path / "hf"), str(tmp_path / "legacy")
    _write_hf_llama(hf_dir)
    _write_legacy_checkpoint(legacy_dir)
    refused = "--target-tensor-parallel-size 4: the model's 2 key/value heads (--num-query-groups) do not split evenly"
    for loader, load_dir in ((["--loader", "llama_mistral", "--checkpoint-type", "hf"], hf_dir),
                             (["--loader", "legacy"], legacy_dir)):
        save_dir = str(tmp_path / f"out_{loader[1]}")
        with pytest.raises(SystemExit) as exit_info:
            convert.main(["--model-type", "GPT", *loader, "--saver", "core", "--load-dir", load_dir, "--save-dir",
                          save_dir, "--target-tensor-parallel-size", "4"])
        assert str(exit_info.value.code).startswith(refused), exit_info.value.code
        assert f"nothing was written to {save_dir}" in str(exit_info.value.code)
        assert not os.path.exists(save_dir)
    # at a size it takes, the advice gives the padding of the embedding's rows at that size
    convert.main(["--model-type", "GPT", "--loader", "llama_mistral", "--checkpoint-type", "hf", "--saver", "core",
                  "--load-dir", hf_dir, "--save-dir", str(tmp_path / "tp2"), "--target-tensor-parallel-size", "2",
                  "--true-vocab-size", "40"])
    assert "--make-vocab-size-divisible-by 128, which pads its 40 tokens to the embedding's 128 rows at TP 1 (64 at " \
           "TP 2" in capsys.readouterr().out


def _release(root):
    """Turn the checkpoint under `root` into a released one, as upstream publishes them: its only iteration
    directory renamed `release`, the tracker holding the word `release`."""
    (iteration_dir,) = [name for name in os.listdir(root) if name.startswith("iter_")]
    os.rename(os.path.join(root, iteration_dir), os.path.join(root, "release"))
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as stream:
        stream.write("release")


def test_a_released_checkpoint_converts_to_a_released_one(tools, tmp_path, capsys):
    """A tracker that says `release` stays `release` through --saver core (torch_dist and --ckpt-format torch
    inputs, from the root or its release directory), with the weights of the input."""
    convert, convert_checkpoint = tools
    hf_dir, core_dir, legacy_dir = str(tmp_path / "hf"), str(tmp_path / "core"), str(tmp_path / "legacy")
    _write_hf_llama(hf_dir)
    convert_checkpoint.from_hf(hf_dir, core_dir)
    original = _model(_read(core_dir))
    _release(core_dir)
    _write_legacy_checkpoint(legacy_dir)
    _release(legacy_dir)
    for name, load_dir in (("from_root", core_dir), ("from_release_dir", os.path.join(core_dir, "release")),
                           ("from_legacy", legacy_dir)):
        save_dir = tmp_path / name
        convert.main(["--model-type", "GPT", "--loader", "core", "--saver", "core", "--load-dir", load_dir,
                      "--save-dir", str(save_dir)])
        assert "a torch_dist checkpoint (released: its tracker says release)" in capsys.readouterr().out
        assert (save_dir / "latest_checkpointed_iteration.txt").read_text() == "release"
        assert sorted(os.listdir(save_dir)) == ["latest_checkpointed_iteration.txt", "release"]
        assert json.loads((save_dir / "release" / "metadata.json").read_text())["iteration"] == "release"
        if name != "from_legacy":
            _assert_same_tensors(_model(_read(str(save_dir))), original)
    legacy_weight = _read(str(tmp_path / "from_legacy"))["model.decoder.layers.0.self_attention.linear_qkv.weight"]
    assert legacy_weight.shape == (HEADS * HEAD_DIM, HIDDEN)


def test_a_target_pipeline_size_that_does_not_divide_the_layers_is_named(tools):
    """Training splits the layers evenly over the pipeline stages unless its uneven-split flags say otherwise: a
    target size training would refuse is refused, one the recorded uneven split allows is not."""
    import argparse

    convert, _ = tools
    even = argparse.Namespace(num_layers=4, num_attention_heads=4)
    assert convert.target_size_problems(even, 1, 2, 1) == convert.target_size_problems(even, 1, 4, 1) == []
    assert convert.target_size_problems(even, 1, 3, 1) == [
        "--target-pipeline-parallel-size 3: the model's 4 layers (--num-layers) do not split evenly over it, which "
        "training needs without --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers or "
        "--pipeline-model-parallel-layout (the checkpoint written is the same at any target size: give one that "
        "divides the layers, and those flags to the training run)"]
    uneven = argparse.Namespace(num_layers=4, num_attention_heads=4, decoder_first_pipeline_num_layers=2)
    assert convert.target_size_problems(uneven, 1, 3, 1) == []


def test_the_printed_torch_format_launch_passes_training_validation(tools, tmp_path, capsys):
    """The pretrain_gpt.py --ckpt-convert-format torch launch convert.py prints names every flag training asks
    for: with its placeholders filled in as it says, pretrain_gpt.py's argument validation takes it. A checkpoint
    imported from Hugging Face records no sequence length and no tokenizer, which the launch then names."""
    import re
    from unittest import mock

    from megatron.training.arguments import parse_args, validate_args

    convert, _ = tools
    hf_dir, core_dir, torch_dir = (str(tmp_path / name) for name in ("hf", "core", "torch"))
    _write_hf_llama(hf_dir)
    convert.main([*HF_TO_CORE, "--load-dir", hf_dir, "--save-dir", core_dir])
    printed = capsys.readouterr().out
    ranks, launch = re.search(r"torchrun --nproc-per-node (\d+) pretrain_gpt\.py (--load [^(,;]*)", printed).groups()
    assert "--seq-length SEQ_LENGTH: the training's sequence length, at most 64" in printed
    assert (f"TOKENIZER_FLAGS: the training's tokenizer, as the checkpoint records none: its --tokenizer-type and "
            f"files ({VOCAB} tokens), or --tokenizer-type NullTokenizer --vocab-size {VOCAB - 1} with --mock-data"
            ) in printed
    launch = launch.replace("TORCH_DIR", torch_dir).replace("SEQ_LENGTH", "64").replace(
        "TOKENIZER_FLAGS", f"--tokenizer-type NullTokenizer --vocab-size {VOCAB - 1}")
    with mock.patch.dict(os.environ, {"WORLD_SIZE": ranks, "RANK": "0"}):
        args = validate_args(parse_args(args=launch.split()))
    assert (args.ckpt_convert_format, args.ckpt_convert_save, args.tensor_model_parallel_size) == (
        "torch", torch_dir, 2)
    assert (args.seq_length, args.vocab_size, args.padded_vocab_size, args.num_layers) == (64, VOCAB - 1, 128, LAYERS)


def test_a_checkpoint_recording_its_sequence_length_and_tokenizer_needs_neither_in_the_printed_launch(tools):
    import argparse

    convert, _ = tools
    saved = argparse.Namespace(seq_length=16, max_position_embeddings=16, tokenizer_type="NullTokenizer")
    assert convert._unrecorded_model_flags({"args": saved, "vocab_size": 121}) == {}
