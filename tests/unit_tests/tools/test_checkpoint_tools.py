"""tools/checkpoint: inspect, torch.save / safetensors round trips, and legacy torch-format conversion.

A TP2 run (SwiGLU, untied output layer) writes the same state in both formats; the legacy conversion joins the
tensor-parallel partitions and must reproduce the torch_dist checkpoint's logical tensors exactly.
"""

import glob
import os
import re
import sys

import pytest
import torch

from tests.unit_tests.dist_checkpointing.pretrain_helpers import TrainingState
from tests.unit_tests.multiprocess_harness import run_on_ranks

TOOLS = os.path.join(os.path.dirname(__file__), "..", "..", "..", "tools", "checkpoint")


@pytest.fixture(scope="module")
def tools():
    sys.path.insert(0, os.path.abspath(TOOLS))
    import convert_checkpoint
    import convert_legacy
    import inspect_checkpoint

    yield convert_checkpoint, convert_legacy, inspect_checkpoint
    sys.path.remove(os.path.abspath(TOOLS))


def _save_both_formats(workdir, layout="--tensor-model-parallel-size 2"):
    from megatron.training import checkpointing

    state = TrainingState(f"{layout} --ckpt-format torch")
    state.train_steps(2)
    state.args.save = os.path.join(workdir, "legacy")
    checkpointing.save_checkpoint(2, state.model, state.optimizer, state.scheduler, state.args)
    state.args.ckpt_format, state.args.save = "torch_dist", os.path.join(workdir, "dist")
    checkpointing.save_checkpoint(2, state.model, state.optimizer, state.scheduler, state.args)
    state.close()


def test_checkpoint_tools(tmp_path, tools, capsys):
    from megatron.core.dist_checkpointing import offline, safetensors_format

    convert_checkpoint, convert_legacy, inspect_checkpoint = tools
    run_on_ranks(2, _save_both_formats, str(tmp_path))
    dist_root = str(tmp_path / "dist")
    reference = offline.read_checkpoint(os.path.join(dist_root, "iter_0000002"))
    model, optimizer, rest = offline.split_state(reference)
    # full SwiGLU fc1 (gate and up rows of 64 units), each TP rank having held 64 rows
    assert model["decoder.layers.3.mlp.linear_fc1.weight"].shape == (128, 32)
    assert rest["common"]["iteration"] == 2 and rest["common"]["layout"]["tensor_model_parallel_size"] == 2
    assert set(optimizer) >= {"optimizer.state.decoder.layers.0.mlp.linear_fc1.weight.exp_avg",
                              "optimizer.state.decoder.layers.0.mlp.linear_fc1.weight.exp_avg_sq"}

    # inspect
    lines = []
    inspect_checkpoint.inspect(dist_root, out=lines.append)
    text = "\n".join(lines)
    assert "iteration: 2" in text and "tensor_model_parallel_size: 2" in text and "wrapper: ddp" in text
    assert re.search(r"model\.decoder\.layers\.3\.mlp\.linear_fc1\.weight +float32 +128x32 +chunks=2", text)
    assert f"{len(model) + len(optimizer)} tensors" in text

    # torch.save and back: every key comes back equal
    convert_checkpoint.to_torch(dist_root, str(tmp_path / "full.pt"))
    saved = torch.load(tmp_path / "full.pt", weights_only=False)
    assert set(saved["model"]) == set(model) and all(v.dtype == torch.float32 for v in saved["model"].values())
    convert_checkpoint.from_torch(str(tmp_path / "full.pt"), str(tmp_path / "back"))
    back = offline.read_checkpoint(os.path.join(tmp_path, "back", "iter_0000002"))
    for key, value in reference.items():
        if key.startswith("rng_state."):  # each rank's streams, for a resume that draws the same dropout masks
            assert torch.equal(back[key]["torch_rng_state"], value["torch_rng_state"]), key
            assert back[key]["random_rng_state"] == value["random_rng_state"], key
        elif torch.is_tensor(value):
            assert torch.equal(back[key], value), key
    assert back["common"]["rng_coordinates"] == reference["common"]["rng_coordinates"]
    assert back["scheduler"] == reference["scheduler"]
    assert back["optimizer.step"] == reference["optimizer.step"] == 2

    # safetensors and back (model only); the file is also readable by the safetensors package when installed
    path = str(tmp_path / "model.safetensors")
    convert_checkpoint.to_safetensors(dist_root, path)
    tensors, metadata = safetensors_format.load_file(path)
    assert metadata["iteration"] == "2" and all(torch.equal(tensors[k], v) for k, v in model.items())
    try:
        from safetensors.torch import load_file as reference_load_file
    except ImportError:
        reference_load_file = None
    if reference_load_file is not None:
        read_by_safetensors = reference_load_file(path)
        assert all(torch.equal(read_by_safetensors[k], v) for k, v in model.items())
    convert_checkpoint.from_safetensors(path, str(tmp_path / "from_st"))
    from_st = offline.read_checkpoint(os.path.join(tmp_path, "from_st", "iter_0000002"))
    assert {k for k in from_st if k.startswith("model.")} == {f"model.{k}" for k in model}
    assert all(torch.equal(from_st[f"model.{k}"], v) for k, v in model.items())

    # legacy torch format -> logical: equal to what torch_dist wrote from the same state
    converted, iteration, _ = convert_legacy.convert(str(tmp_path / "legacy"), str(tmp_path / "from_legacy"))
    assert iteration == 2 and set(converted) == set(model)
    for name, value in model.items():
        assert torch.equal(converted[name], value), name
    _check_converted_like_torch_dist(reference, os.path.join(tmp_path, "from_legacy", "iter_0000002"))
    # A legacy checkpoint written before the optimizer's parameter names were recorded: the default grouping
    # rebuilds them.
    for path in glob.glob(os.path.join(tmp_path, "legacy", "iter_0000002", "mp_rank_*", "model_optim_rng.pt")):
        legacy = torch.load(path, weights_only=False)
        assert legacy.pop("optimizer_param_names") is not None
        torch.save(legacy, path)
    convert_legacy.convert(str(tmp_path / "legacy"), str(tmp_path / "from_older_legacy"))
    _check_converted_like_torch_dist(reference, os.path.join(tmp_path, "from_older_legacy", "iter_0000002"))


def _check_converted_like_torch_dist(reference, converted_dir):
    """The converted checkpoint holds every tensor and object torch_dist wrote from the same state, equal."""
    from megatron.core.dist_checkpointing import offline

    converted = offline.read_checkpoint(converted_dir)
    for key, value in reference.items():
        if torch.is_tensor(value):
            assert torch.equal(converted[key], value), key
    for key in ("scheduler", "optimizer.step", "optimizer.param_groups", "optimizer.grad_scaler"):
        assert converted[key] == reference[key], key
    # RNG states: the same per-rank states, each with the coordinates of the rank that drew it
    saved = {reference["common"]["rng_coordinates"][int(key.split(".")[1])]: value
             for key, value in reference.items() if key.startswith("rng_state.")}
    back = {converted["common"]["rng_coordinates"][int(key.split(".")[1])]: value
            for key, value in converted.items() if key.startswith("rng_state.")}
    assert sorted(back) == sorted(saved)
    for coordinates, state in saved.items():
        assert torch.equal(back[coordinates]["torch_rng_state"], state["torch_rng_state"]), coordinates
        assert back[coordinates]["random_rng_state"] == state["random_rng_state"], coordinates
    assert {k: v for k, v in converted["common"].items() if k not in ("layout", "rng_coordinates", "args")} == \
        {k: v for k, v in reference["common"].items() if k not in ("layout", "rng_coordinates", "args")}


@pytest.mark.parametrize("split", ["", "--decoder-first-pipeline-num-layers 1"], ids=["even", "first_stage_1_layer"])
def test_legacy_conversion_of_pipeline_stages_with_tied_embeddings(tmp_path, tools, split):
    from megatron.core.dist_checkpointing import offline

    _, convert_legacy, _ = tools
    run_on_ranks(2, _save_both_formats, str(tmp_path), f"TIED --pipeline-model-parallel-size 2 {split}")
    model, _, _ = offline.split_state(offline.read_checkpoint(os.path.join(tmp_path, "dist", "iter_0000002")))
    # Layers 2-3 (1-3 with one layer on the first stage) come from the second stage, renumbered by the saved
    # split; its tied output-layer copy is not a tensor of its own.
    assert "decoder.layers.3.mlp.linear_fc2.weight" in model and "output_layer.weight" not in model
    converted, _, _ = convert_legacy.convert(str(tmp_path / "legacy"), str(tmp_path / "from_legacy"))
    assert set(converted) == set(model)
    for name, value in model.items():
        assert torch.equal(converted[name], value), name
    reference = offline.read_checkpoint(os.path.join(tmp_path, "dist", "iter_0000002"))
    _check_converted_like_torch_dist(reference, os.path.join(tmp_path, "from_legacy", "iter_0000002"))


def test_legacy_conversion_of_distributed_optimizer_shards_in_bf16(tmp_path, tools):
    from megatron.core.dist_checkpointing import offline

    _, convert_legacy, _ = tools
    run_on_ranks(2, _save_both_formats, str(tmp_path), "--use-distributed-optimizer --bf16")
    reference = offline.read_checkpoint(os.path.join(tmp_path, "dist", "iter_0000002"))
    assert any(key.endswith(".fp32_param") for key in reference)  # bf16 weights: fp32 main weights saved too
    convert_legacy.convert(str(tmp_path / "legacy"), str(tmp_path / "from_legacy"))
    _check_converted_like_torch_dist(reference, os.path.join(tmp_path, "from_legacy", "iter_0000002"))


# Training resumed from a converted legacy checkpoint continues like training resumed from the legacy one.
# Saved at iteration 2 of 4: iteration 3 tests the loaded weights, 4 the loaded optimizer state too.
FOUR_ITERATIONS = "--train-iters 4 --lr-decay-iters 4"
LEGACY_LAYOUTS = {
    "distributed_optimizer": ("--use-distributed-optimizer", "--use-megatron-fsdp"),
    "tp2_bf16": ("--tensor-model-parallel-size 2 --bf16", "--use-distributed-optimizer --bf16"),
    "tied_pp2": ("TIED --pipeline-model-parallel-size 2 --use-distributed-optimizer",
                 "TIED --use-distributed-optimizer"),
}


def _resume_legacy_and_converted(workdir, layouts):
    from megatron.training.checkpointing import write_tracker
    from tests.unit_tests.dist_checkpointing.pretrain_helpers import run_pretrain

    sys.path.insert(0, os.path.abspath(TOOLS))
    import convert_legacy

    results = {}
    for name, (layout, other_layout) in layouts.items():
        legacy, converted = os.path.join(workdir, f"{name}_legacy"), os.path.join(workdir, f"{name}_converted")
        layout, other_layout = f"{layout} {FOUR_ITERATIONS}", f"{other_layout} {FOUR_ITERATIONS}"
        reference = run_pretrain(workdir, f"{layout} --save {legacy} --save-interval 2 --ckpt-format torch")
        if torch.distributed.get_rank() == 0:
            write_tracker(legacy, 2)
            convert_legacy.convert(legacy, converted)
        torch.distributed.barrier()
        results[name] = (
            reference,
            run_pretrain(workdir, f"{layout} --load {legacy} --ckpt-format torch"),
            run_pretrain(workdir, f"{layout} --load {converted} --ckpt-format torch_dist"),
            run_pretrain(workdir, f"{other_layout} --load {converted} --ckpt-format torch_dist"),
        )
    return results


@pytest.mark.world_size(2)
def test_training_resumed_from_converted_legacy_checkpoint_equals_resumed_from_legacy(tmp_path):
    results = run_on_ranks(2, _resume_legacy_and_converted, str(tmp_path), LEGACY_LAYOUTS)[0]
    for name, (reference, from_legacy, from_converted, at_other_layout) in results.items():
        assert sorted(reference) == list(range(1, 5)) and from_legacy == {i: reference[i] for i in (3, 4)}, name
        assert from_converted == from_legacy, name  # same layout: identical
        # Another layout or wrapper: 1e-6 relative in fp32, 1e-4 in bf16 (as in dist_checkpointing/test_resume.py)
        tolerance = 1e-4 if "bf16" in name else 1e-6
        assert sorted(at_other_layout) == [3, 4], name
        for iteration, loss in at_other_layout.items():
            assert loss == pytest.approx(from_legacy[iteration], rel=tolerance, abs=0), (name, iteration)


def _exit_message(main, argv):
    """The message `main(argv)` exits with (argparse's errors print theirs and exit with status 2)."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    return exit_info.value.code


def test_convert_checkpoint_names_the_input_and_what_to_run(tmp_path, tools, capsys):
    """Inputs of another kind than the direction reads: the exit names --input, what it is and what to run."""
    from megatron.core.dist_checkpointing import safetensors_format

    convert_checkpoint = tools[0]
    legacy = tmp_path / "legacy"
    os.makedirs(legacy / "iter_0000002" / "mp_rank_00")
    torch.save({"model": {}}, legacy / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt")
    (legacy / "latest_checkpointed_iteration.txt").write_text("2")
    hf_dir, empty_dir = tmp_path / "hf", tmp_path / "empty"
    os.makedirs(hf_dir)
    os.makedirs(empty_dir)
    (hf_dir / "config.json").write_text("{}")
    torch_file, safetensors_file = str(tmp_path / "full.pt"), str(tmp_path / "model.safetensors")
    torch.save({"model": {"w": torch.ones(2)}}, torch_file)
    safetensors_format.save_file({"w": torch.ones(2)}, safetensors_file, {"iteration": 3})
    for source, expected in [
        (legacy, f"--input {legacy}: a legacy --ckpt-format torch checkpoint (mp_rank_* directories), not the "
                 f"logical torch_dist format; convert it first with: python tools/checkpoint/convert_legacy.py "
                 f"--input {legacy} --output NEW_ROOT"),
        (hf_dir, f"--input {hf_dir}: a Hugging Face model directory, not a torch_dist checkpoint; import it with: "
                 f"python tools/checkpoint/convert_checkpoint.py --from hf --input {hf_dir} --output NEW_ROOT"),
        (empty_dir, f"--input {empty_dir}: not a torch_dist checkpoint ({empty_dir} has no .metadata)"),
        (torch_file, f"--input {torch_file}: a file, not a checkpoint directory"),
        (tmp_path / "missing", f"--input {tmp_path / 'missing'}: no such directory"),
    ]:
        for target in ("torch", "hf"):
            message = _exit_message(convert_checkpoint.main, ["--to", target, "--input", str(source), "--output",
                                                              str(tmp_path / "out")])
            assert message.startswith(expected), message
    message = _exit_message(convert_checkpoint.main, ["--from", "safetensors", "--input", torch_file, "--output",
                                                      str(tmp_path / "out")])
    assert message.startswith(f"--input {torch_file}: ") and "one from --to torch converts with --from torch" in message
    message = _exit_message(convert_checkpoint.main, ["--from", "torch", "--input", str(legacy / "latest_"
                                                      "checkpointed_iteration.txt"), "--output", str(tmp_path / "out")])
    assert "not a torch.save file (UnpicklingError" in message and "--from torch reads the file --to torch" in message
    capsys.readouterr()
    for source, argv in [("torch", ["--input", str(tmp_path / "nope.pt")]), ("safetensors", ["--input", str(legacy)]),
                         ("hf", ["--input", torch_file])]:
        assert _exit_message(convert_checkpoint.main, ["--from", source, *argv, "--output",
                                                       str(tmp_path / "unused")]) == 2
        error = capsys.readouterr().err.splitlines()[-1]
        kind = "directory" if source == "hf" else "file"
        assert f": error: --input {argv[1]}: not a {kind} (--from {source} reads " in error
    assert not os.path.exists(tmp_path / "out") and not os.path.exists(tmp_path / "unused")
    # The files that were read in this test convert back.
    convert_checkpoint.main(["--from", "safetensors", "--input", safetensors_file, "--output", str(tmp_path / "st")])
    assert (tmp_path / "st" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
