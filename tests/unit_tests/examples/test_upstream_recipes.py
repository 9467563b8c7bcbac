"""The launch scripts that carry upstream Megatron-LM's recipes (examples/gpt3, llama, mixtral, deepseek_v3,
gpt_oss): the flags each passes to pretrain_gpt.py at full size parse and validate at the world size the recipe
runs on and describe the model's real shape, and their TINY=1 mode trains on 2 CPU ranks.

Each script prints its flags, one per line, under PRINT_ARGS=1 instead of launching."""

import json
import math
import os
import subprocess
from pathlib import Path

import pytest

from megatron.training.arguments import parse_args, validate_args
from megatron.training.tokenizer.tokenizer import pad_vocab_size
from tests.unit_tests.examples.forked_launches import LAUNCH_ENV

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"

# script -> (world size the full recipe runs on, attributes of the validated full-size arguments)
RECIPES = {
    "gpt3/train_gpt3_175b_distributed.sh": (128, {
        "num_layers": 96, "hidden_size": 12288, "num_attention_heads": 96, "ffn_hidden_size": 4 * 12288,
        "seq_length": 2048, "tensor_model_parallel_size": 8, "pipeline_model_parallel_size": 16,
        "data_parallel_size": 1, "fp16": True, "rampup_batch_size": (16, 16, 5859375),
        "global_batch_size": 1536, "train_samples": 500000 * 1536, "lr_decay_samples": 430000 * 1536,
        "distributed_backend": "nccl",
    }),
    "llama/train_llama3_8b.sh": (8, {
        "num_layers": 32, "hidden_size": 4096, "ffn_hidden_size": 14336, "num_attention_heads": 32,
        "num_query_groups": 8, "kv_channels": 128, "seq_length": 8192, "vocab_size": 128256,
        "rotary_base": 500000, "data_parallel_size": 8, "use_distributed_optimizer": True,
        "overlap_param_gather": True, "bf16": True, "fp8_format": "hybrid", "fp8_param_gather": True,
        "train_samples": 1953125000, "distributed_backend": "nccl",
    }),
    "mixtral/train_mixtral_8x7b_distributed.sh": (32, {
        "num_layers": 32, "hidden_size": 4096, "ffn_hidden_size": 14336, "num_query_groups": 8,
        "num_experts": 8, "moe_router_topk": 2, "max_position_embeddings": 32768, "rotary_base": 1000000,
        "pipeline_model_parallel_size": 4, "expert_model_parallel_size": 8, "data_parallel_size": 8,
        "moe_token_dispatcher_type": "alltoall", "bf16": True, "distributed_backend": "nccl",
    }),
    "deepseek_v3/train_deepseek_v3_proxy.sh": (1024, {
        "num_layers": 61, "hidden_size": 7168, "ffn_hidden_size": 18432, "num_attention_heads": 128,
        "multi_latent_attention": True, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_head_dim": 128,
        "qk_pos_emb_head_dim": 64, "v_head_dim": 128, "rotary_scaling_factor": 40.0, "num_experts": 256,
        "moe_ffn_hidden_size": 2048, "moe_shared_expert_intermediate_size": 2048, "moe_router_topk": 8,
        "moe_router_num_groups": 8, "moe_router_group_topk": 4, "moe_router_score_function": "sigmoid",
        "moe_router_enable_expert_bias": True, "mtp_num_layers": 1, "vocab_size": 129280,
        "pipeline_model_parallel_size": 16, "expert_model_parallel_size": 64, "data_parallel_size": 64,
        "distributed_backend": "nccl",
    }),
    "gpt_oss/train_gpt_oss_20b.sh": (8, {
        "num_layers": 24, "hidden_size": 2880, "num_attention_heads": 64, "kv_channels": 64,
        "num_query_groups": 8, "num_experts": 32, "moe_router_topk": 4, "moe_ffn_hidden_size": 2880,
        "vocab_size": 201088, "max_position_embeddings": 131072, "position_embedding_type": "yarn",
        "yarn_rotary_scaling_factor": 32.0, "yarn_original_max_position_embeddings": 4096,
        "window_attn_skip_freq": 2, "softmax_type": "learnable", "quick_geglu": True,
        "activation_func_clamp_value": 7.0, "glu_linear_offset": 1.0, "moe_router_bias": True,
        "add_qkv_bias": True, "add_bias_linear": True, "expert_model_parallel_size": 8, "distributed_backend": "nccl",
    }),
}


# the scripts' environment knobs: a test sets the ones it needs and never inherits them
KNOBS = ("TINY", "PRINT_ARGS", "RUN_DIR", "DATA_PATH", "DTYPE", "TRAIN_ITERS", "CHECKPOINT_DIR", "TENSORBOARD_DIR",
         "DATA_CACHE_DIR", "OUTPUT_DIR")


def knob_free_environment(**knobs):
    return {**{name: value for name, value in os.environ.items() if name not in KNOBS}, **knobs}


def printed_flags(script, run_dir, **knobs):
    env = knob_free_environment(PRINT_ARGS="1", RUN_DIR=str(run_dir), **knobs)
    printed = subprocess.run(["bash", str(EXAMPLES / script)], env=env, check=True, capture_output=True, text=True)
    return [word for word in printed.stdout.split("\n") if word]


def validated(argv, world_size, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setenv("RANK", "0")
    return validate_args(parse_args(args=argv))


@pytest.mark.parametrize("script", RECIPES)
def test_full_size_flags_validate(script, monkeypatch, tmp_path):
    world_size, expected = RECIPES[script]
    args = validated(printed_flags(script, tmp_path), world_size, monkeypatch)
    assert {name: getattr(args, name) for name in expected} == expected
    assert args.save == str(tmp_path / "checkpoints") and args.mock_data


def test_gpt_oss_window_is_128_positions_on_alternate_layers(monkeypatch, tmp_path):
    args = validated(printed_flags("gpt_oss/train_gpt_oss_20b.sh", tmp_path), 8, monkeypatch)
    assert tuple(args.window_size) == (127, 0)


def test_deepseek_v3_layout_and_dense_layers(monkeypatch, tmp_path):
    argv = printed_flags("deepseek_v3/train_deepseek_v3_proxy.sh", tmp_path)
    args = validated(argv, 1024, monkeypatch)
    assert argv[argv.index("--pipeline-model-parallel-layout") + 1] == "Et|(tt|)*30mL"
    assert argv[argv.index("--moe-layer-freq") + 1] == "([0]*3+[1]*58)"
    assert args.make_vocab_size_divisible_by * 40 == args.vocab_size


def test_llama_bf16_drops_only_the_fp8_flags(monkeypatch, tmp_path):
    fp8 = printed_flags("llama/train_llama3_8b.sh", tmp_path)
    bf16 = printed_flags("llama/train_llama3_8b.sh", tmp_path, DTYPE="bf16")
    assert [word for word in fp8 if word not in bf16] == [
        "--fp8-format", "hybrid", "--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo", "max",
        "--fp8-param-gather"]
    assert validated(bf16, 8, monkeypatch).fp8_format is None


@pytest.mark.parametrize("script", RECIPES)
def test_tiny_flags_validate_on_two_ranks(script, monkeypatch, tmp_path):
    args = validated(printed_flags(script, tmp_path, TINY="1"), 2, monkeypatch)
    assert args.distributed_backend == "gloo" and args.mock_data and args.num_workers == 0
    assert args.hidden_size == 64


# The script whose tiny run goes through its own launch line (examples/recipe_launch.sh: `torchrun --standalone
# --nproc-per-node 2 pretrain_gpt.py ...`, the same line for every recipe) with a `torchrun` on PATH that records
# what it is given; the other recipes' ranks run the flags their script prints. Every run's ranks are forked from the
# functional tests' launch server (forked_launches.py: the environment torchrun gives a rank, torch and Megatron
# imported once; test_runner.py holds a torchrun launch of that form and the server to the same metrics bit for bit).
LAUNCHED_THROUGH_ITS_SCRIPT = "llama/train_llama3_8b.sh"

# oneDNN's instruction set for each capability below AVX-512 that ATEN_CPU_CAPABILITY can select (its lowest x86-64
# one for `default`). A CPU without AVX-512 has no AMX, but oneDNN picks its kernels from the host, not from
# ATEN_CPU_CAPABILITY: on an AMX host, torch 2.13's bf16 flash attention (a key length of 64 or more, as in the bf16
# recipes' tiny runs) then packs for AMX through a routine only its AVX-512 build has, and raises "pack_vnni2 is
# only supported when avx512 is supported". Capping oneDNN as well runs the ranks as such a CPU would.
ONEDNN_ISA_FOR_CAPABILITY = {"default": "SSE41", "avx2": "AVX2"}


def cpu_isa_environment():
    """ONEDNN_MAX_CPU_ISA for the ranks when ATEN_CPU_CAPABILITY selects a capability below AVX-512 (unless set)."""
    isa = ONEDNN_ISA_FOR_CAPABILITY.get(os.environ.get("ATEN_CPU_CAPABILITY", "").lower())
    return {"ONEDNN_MAX_CPU_ISA": os.environ.get("ONEDNN_MAX_CPU_ISA", isa)} if isa else {}


# Full batches each tiny run trains. GPT-3's are 2: its fp16 GEMMs, on a CPU without AVX512-FP16, are more than 10
# times slower than fp32 ones, and 2 batches already show its ramp-up (4, 4, then 8 samples: 3 iterations).
TINY_TRAIN_ITERS = {script: 2 if "gpt3" in script else 3 for script in RECIPES}


def _torchrun_arguments(script, run_dir, extra, train_iters):
    """What the script's TINY=1 launch passes to `torchrun` (a recording one on PATH), one item per argument."""
    bin_dir = run_dir / "bin"
    bin_dir.mkdir()
    recorder = bin_dir / "torchrun"
    recorder.write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@" > "$TORCHRUN_ARGS"\n')
    recorder.chmod(0o755)
    recorded = run_dir / "torchrun_args"
    env = knob_free_environment(TINY="1", TRAIN_ITERS=train_iters, RUN_DIR=str(run_dir), TORCHRUN_ARGS=str(recorded),
                                PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    launch = subprocess.run(["bash", str(EXAMPLES / script), *extra], env=env, capture_output=True, text=True,
                            timeout=60)
    assert launch.returncode == 0, launch.stdout[-3000:] + launch.stderr[-3000:]
    return recorded.read_text().splitlines()


def _train_tiny(script, run_dir, metrics_file, launch_server):
    extra = ["--metrics-file", str(metrics_file)]
    train_iters = str(TINY_TRAIN_ITERS[script])
    argv = printed_flags(script, run_dir, TINY="1", TRAIN_ITERS=train_iters) + extra
    if script == LAUNCHED_THROUGH_ITS_SCRIPT:
        launched = _torchrun_arguments(script, run_dir, extra, train_iters)
        assert launched[:3] == ["--standalone", "--nproc-per-node", "2"], launched[:4]
        assert Path(launched[3]).resolve() == EXAMPLES.parent / "pretrain_gpt.py"
        assert launched[4:] == argv
    log = run_dir / "ranks.log"
    answer = launch_server.launch(argv, {**LAUNCH_ENV, **cpu_isa_environment()}, 2, run_dir, log, 300)
    assert answer["returncodes"] == [0, 0] and not answer["timed_out"], log.read_text()[-6000:]


@pytest.mark.slow  # a 2-rank launch per script, 1-4 s each on 2 cores
@pytest.mark.parametrize("script", RECIPES)
def test_tiny_mode_trains_on_two_cpu_ranks(script, monkeypatch, tmp_path, launch_server):
    args = validated(printed_flags(script, tmp_path, TINY="1"), 2, monkeypatch)
    metrics_file = tmp_path / "metrics.jsonl"
    _train_tiny(script, tmp_path, metrics_file, launch_server)
    records = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    train = [record for record in records if record["split"] == "train"]
    # GPT-3's batch ramp-up (4, then 8 samples) takes 3 iterations for 2 full batches; the others keep one batch size
    batch_sizes = [record["consumed-samples"] - before for record, before in
                   zip(train, [0] + [record["consumed-samples"] for record in train])]
    assert batch_sizes == ([4, 4, 8] if "gpt3" in script else [batch_sizes[0]] * 3), batch_sizes
    assert [record["iteration"] for record in train] == list(range(1, 4))
    assert not any(record["skipped"] for record in train)
    # near-uniform logits at initialisation: the loss starts at ln(padded vocabulary)
    padded_vocab = pad_vocab_size(args.vocab_size + 1, args.make_vocab_size_divisible_by,
                                  args.tensor_model_parallel_size)
    assert train[0]["lm loss"] == pytest.approx(math.log(padded_vocab), abs=0.05)
    assert all(0.0 < record["grad norm"] < 10.0 for record in train)
    if args.num_experts:
        # balanced routing at initialisation: each load-balancing loss, logged over its coefficient, is about 1
        balancing = [value for name, value in train[0].items() if name.endswith("load_balancing_loss")]
        assert balancing and all(value == pytest.approx(1.0, abs=0.05) for value in balancing)
    if args.mtp_num_layers:
        assert train[0]["mtp_1 loss"] == pytest.approx(math.log(padded_vocab), abs=0.05)
    assert (tmp_path / "checkpoints").is_dir()
