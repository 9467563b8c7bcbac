"""examples/megatron_fsdp/train_llama3_fsdp_cpu.sh: the flags it passes to pretrain_gpt.py parse and validate at
its 2 ranks, and carry upstream's recipe values (the sample-based schedule, decoupled learning rates, fused cross
entropy, run control, Megatron-FSDP ZeRO-3 with fsdp_dtensor checkpoints, TikTokenizer v2)."""

import os
import subprocess
from pathlib import Path

from megatron.training.arguments import parse_args, validate_args

SCRIPT = Path(__file__).resolve().parents[3] / "examples" / "megatron_fsdp" / "train_llama3_fsdp_cpu.sh"


def test_recipe_flags_validate(monkeypatch, tmp_path):
    env = {**os.environ, "PRINT_ARGS": "1", "RUN_DIR": str(tmp_path)}
    argv = subprocess.run(["bash", str(SCRIPT)], env=env, check=True, capture_output=True, text=True).stdout.split("\n")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    args = validate_args(parse_args(args=[word for word in argv if word]))
    assert (args.train_samples, args.global_batch_size, args.train_iters) == (160, 8, 20)
    assert (args.lr_decay_samples, args.lr_warmup_samples) == (156, 16)
    assert (args.decoupled_lr, args.decoupled_min_lr) == (5.0e-4, 4.5e-5)
    assert args.cross_entropy_loss_fusion and args.calculate_per_token_loss and args.manual_gc
    assert (args.empty_unused_memory_level, args.exit_duration_in_mins, args.logging_level) == (1, 235, 20)
    assert args.use_megatron_fsdp and args.data_parallel_sharding_strategy == "optim_grads_params"
    assert args.init_model_with_meta_device and args.fsdp_double_buffer and args.ckpt_format == "fsdp_dtensor"
    assert args.bf16 and args.grad_reduce_in_bf16
    assert (args.tokenizer_type, args.tiktoken_pattern) == ("TikTokenizer", "v2")
    assert args.tokenizer_model == str(tmp_path / "byte_tiktoken.json")
