"""tools/checkpoint with a DeepSeek-style checkpoint (multi-latent attention, a dense first layer, then MoE layers
with shared experts and a sigmoid router with expert bias): torch_dist -> torch -> torch_dist and torch_dist ->
safetensors -> torch_dist give back every tensor, and the checkpoint converted back resumes training with the
saved weights; `--to hf` refuses it as a DeepseekV3ForCausalLM (no latent norms, biases, another epsilon), naming
the flags, and `--from hf` refuses latent attention other than DeepSeek-V3's."""

import argparse
import json
import os
import sys

import pytest
import torch

from tests.unit_tests.multiprocess_harness import run_on_ranks

TOOLS = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", "tools", "checkpoint"))
DEEPSEEK_STYLE = (
    "--multi-latent-attention --q-lora-rank 12 --kv-lora-rank 8 --qk-head-dim 6 --qk-pos-emb-head-dim 4 "
    "--v-head-dim 8 --position-embedding-type rope --normalization RMSNorm --num-experts 4 --moe-router-topk 2 "
    "--moe-ffn-hidden-size 24 --moe-shared-expert-intermediate-size 16 --moe-layer-freq ([0]+[1]*3) "
    "--moe-router-score-function sigmoid --moe-router-enable-expert-bias --ckpt-format torch_dist"
)


@pytest.fixture(scope="module")
def convert_checkpoint():
    sys.path.insert(0, TOOLS)
    import convert_checkpoint

    yield convert_checkpoint
    sys.path.remove(TOOLS)


def _model_state(model):
    return {name: tensor.detach().clone() for name, tensor in model[0].state_dict().items()
            if torch.is_tensor(tensor) and not name.endswith("_extra_state")}


def _save(root):
    """One optimizer step of the DeepSeek-style model, saved as torch_dist; its model state."""
    from megatron.training import checkpointing
    from tests.unit_tests.dist_checkpointing.pretrain_helpers import TrainingState

    state = TrainingState(DEEPSEEK_STYLE)
    try:
        state.train_steps(1)
        with torch.no_grad():
            for layer in state.model[0].module.decoder.layers:
                if hasattr(layer.mlp, "router"):
                    layer.mlp.router.expert_bias.copy_(torch.arange(4.0) / 8)  # a buffer with distinct values
        state.args.save = root
        checkpointing.save_checkpoint(1, state.model, state.optimizer, state.scheduler, state.args)
        return _model_state(state.model)
    finally:
        state.close()


def _resume(root):
    """The model state after loading `root` as a resumed run loads it (optimizer and scheduler included)."""
    from megatron.training import checkpointing
    from tests.unit_tests.dist_checkpointing.pretrain_helpers import TrainingState

    state = TrainingState(f"{DEEPSEEK_STYLE} --load {root}")
    try:
        iteration = checkpointing.load_checkpoint(state.model, state.optimizer, state.scheduler, state.args)
        return iteration, _model_state(state.model)
    finally:
        state.close()


def test_deepseek_style_checkpoint_converts_between_our_formats(tmp_path, convert_checkpoint):
    from megatron.core.dist_checkpointing import offline

    root = str(tmp_path / "dist")
    saved = run_on_ranks(1, _save, root)[0]
    reference = offline.read_checkpoint(os.path.join(root, "iter_0000001"))
    model, optimizer, _ = offline.split_state(reference)
    assert {"decoder.layers.0.self_attention.linear_kv_down_proj.weight",
            "decoder.layers.3.mlp.experts.local_experts.3.linear_fc2.weight", "decoder.layers.1.mlp.router.expert_bias",
            "decoder.layers.2.mlp.shared_experts.linear_fc1.weight", "decoder.layers.0.mlp.linear_fc1.weight"} <= set(model)
    assert "optimizer.state.decoder.layers.3.mlp.experts.local_experts.3.linear_fc2.weight.exp_avg" in optimizer

    convert_checkpoint.to_torch(root, str(tmp_path / "full.pt"))
    convert_checkpoint.from_torch(str(tmp_path / "full.pt"), str(tmp_path / "back"))
    back = offline.read_checkpoint(os.path.join(tmp_path, "back", "iter_0000001"))
    compared = 0
    for key, value in reference.items():
        if torch.is_tensor(value) and not key.startswith("rng_state."):
            assert torch.equal(back[key], value), key
            compared += 1
    assert compared == len(model) + len(optimizer)
    assert back["scheduler"] == reference["scheduler"] and back["optimizer.step"] == 1

    convert_checkpoint.to_safetensors(root, str(tmp_path / "model.safetensors"))
    convert_checkpoint.from_safetensors(str(tmp_path / "model.safetensors"), str(tmp_path / "from_safetensors"))
    model_only = offline.full_precision_model(
        offline.read_checkpoint(os.path.join(tmp_path, "from_safetensors", "iter_0000001")))
    assert set(model_only) == set(model) and all(torch.equal(model_only[k], model[k]) for k in model)

    # The torch round trip resumes: iteration 1, the saved weights, expert biases and MLA projections.
    iteration, resumed = run_on_ranks(1, _resume, str(tmp_path / "back"))[0]
    assert iteration == 1 and set(resumed) == set(saved)
    for name, value in saved.items():
        assert torch.equal(resumed[name], value), name

    with pytest.raises(SystemExit) as refusal:
        convert_checkpoint.to_hf(root, str(tmp_path / "hf"))
    for words in ("DeepseekV3ForCausalLM", "no --qk-layernorm", "--disable-bias-linear", "--norm-epsilon 1e-05",
                  "--to torch", "--to safetensors"):
        assert words in str(refusal.value), str(refusal.value)
    assert not os.path.exists(tmp_path / "hf")


def test_hf_refusals_name_the_features(tmp_path, convert_checkpoint):
    import hf_unsupported

    router = hf_unsupported.hf_export_refusal(argparse.Namespace(num_experts=8, multi_latent_attention=False,
                                                                 moe_router_score_function="sigmoid"))
    assert "--moe-router-score-function sigmoid" in router and "--multi-latent-attention" not in router
    assert hf_unsupported.hf_export_refusal(argparse.Namespace(num_experts=8, multi_latent_attention=False,
                                                               moe_router_score_function="softmax")) is None
    assert hf_unsupported.hf_export_refusal(argparse.Namespace(num_experts=None, multi_latent_attention=False)) is None
    for config, flag in (({"architectures": ["DeepseekV2ForCausalLM"], "n_routed_experts": 8}, "--num-experts"),
                         ({"architectures": ["MiniCPM3ForCausalLM"], "kv_lora_rank": 16},
                          "--multi-latent-attention")):
        directory = tmp_path / config["architectures"][0]
        directory.mkdir()
        (directory / "config.json").write_text(json.dumps(config))
        with pytest.raises(SystemExit) as refusal:
            convert_checkpoint.from_hf(str(directory), str(tmp_path / "unused"))
        assert flag in str(refusal.value) and "Qwen3-MoE, gpt-oss and DeepSeek-V3 models only" in str(refusal.value)
