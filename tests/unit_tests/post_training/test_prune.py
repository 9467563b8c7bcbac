"""examples/post_training/prune.py on 2 ranks (DP2): a tiny GPT trained on the corpus is width-pruned (hidden 64 ->
48, FFN 128 -> 64, heads 4 -> 2) and saved as a torch_dist checkpoint; a fresh model of the pruned sizes loaded
from it reproduces the pruned model's logits exactly, and pretrain_gpt's pretrain() continues training it from
that checkpoint (`--load --finetune` with the pruned sizes) with a falling loss. modelopt's own mcore_minitron
plugin needs Transformer Engine: without it `--use-modelopt-plugin` says so; with it (GPU) it runs."""

import json
import math
import os

import pytest
import torch

from megatron.core.optional_deps import HAVE_TE, modelopt_installed
from tests.unit_tests.corpus_data import write_corpus_prefix
from tests.unit_tests.multiprocess_harness import run_on_ranks

TINY_GPT = (
    "--num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 --seq-length 32 "
    "--max-position-embeddings 32 --normalization RMSNorm --swiglu --hidden-dropout 0 --attention-dropout 0 "
    "--make-vocab-size-divisible-by 64 --micro-batch-size 4 --global-batch-size 8 --lr 3e-3 --seed 1234 "
    "--tokenizer-type ByteLevelTokenizer --split 90,10,0 --num-workers 0 --log-interval 1 --ckpt-format torch_dist "
    "--distributed-backend gloo"
)
TARGETS = "--target-hidden-size 48 --target-ffn-hidden-size 64 --target-num-attention-heads 2"
PRUNED_SIZES = "--hidden-size 48 --ffn-hidden-size 64 --num-attention-heads 2 --kv-channels 16"
TRAIN_ITERS, FINETUNE_ITERS = 16, 6
# Upstream Megatron-Core modules modelopt's NAS plugin (under mcore_minitron) imports.
UPSTREAM_MODULES_OF_THE_PLUGIN = ("megatron.core.models.hybrid", "megatron.core.ssm.gated_delta_net",
                                  "megatron.core.models.gpt.moe_module_specs", "megatron.core.transformer.spec_utils")


def _pretrain(argv, metrics):
    import pretrain_gpt
    from megatron.core.enums import ModelType
    from megatron.training.training import pretrain

    if torch.distributed.get_rank() == 0 and os.path.exists(metrics):
        os.remove(metrics)
    torch.distributed.barrier()
    pretrain(pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider,
             ModelType.encoder_or_decoder, pretrain_gpt.forward_step, argv=f"{argv} --metrics-file {metrics}".split())
    torch.distributed.barrier()
    with open(metrics) as stream:
        records = [json.loads(line) for line in stream if line.strip()]
    return [record["lm loss"] for record in records if record.get("split") == "train"]


def _train_prune_finetune(prefix, workdir):
    from examples.post_training import prune
    from examples.post_training.model_and_data import build_model
    from megatron.training import checkpointing
    from megatron.training.initialize import initialize_megatron
    from megatron.training.training import _teardown

    base = f"{TINY_GPT} --data-path {prefix}"
    trained, pruned_root = f"{workdir}/trained", f"{workdir}/pruned"
    train_losses = _pretrain(f"{base} --train-iters {TRAIN_ITERS} --eval-iters 0 --save {trained} "
                             f"--save-interval {TRAIN_ITERS}", f"{workdir}/train.jsonl")

    argv = (f"{base} --train-iters {TRAIN_ITERS} --load {trained} --eval-iters 2 --eval-interval 10 "
            f"--calib-size 16 {TARGETS} --save {pruned_root}")
    args = initialize_megatron(extra_args_provider=prune.add_prune_arguments, args=argv.split())
    try:
        result = prune.run(args)
        pruned = result["model"]
        tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
        positions = torch.arange(32).unsqueeze(0).expand(2, -1)
        with torch.no_grad():
            expected = pruned(tokens, positions)
            restored = build_model(args)  # args now describe the pruned model
            args.load, args.finetune = pruned_root, True
            checkpointing.load_checkpoint([restored], None, None, args)
            actual = restored(tokens, positions)
        summary = {
            "before": result["before"], "after": result["after"], "flags": prune.pruned_model_flags(args),
            "shapes": {name: tuple(p.shape) for name, p in pruned.named_parameters() if "layers.0." in name},
            "kept_heads": [h.tolist() for h in result["kept"].heads],
            "restored_equal": torch.equal(actual, expected),
        }
    finally:
        _teardown(args)

    summary["train_losses"] = train_losses
    summary["finetune_losses"] = _pretrain(f"{base} {PRUNED_SIZES} --train-iters {FINETUNE_ITERS} --eval-iters 0 "
                                           f"--load {pruned_root} --finetune", f"{workdir}/finetune.jsonl")
    return summary


def test_pruned_checkpoint_loads_and_finetunes(tmp_path):
    prefix = write_corpus_prefix(tmp_path, 300)
    results = run_on_ranks(2, _train_prune_finetune, prefix, str(tmp_path))
    assert results[0]["kept_heads"] == results[1]["kept_heads"]  # scores summed over DP: both ranks agree
    result = results[1]
    assert result["flags"] == PRUNED_SIZES
    assert result["shapes"] == {
        "decoder.layers.0.input_layernorm.weight": (48,),
        "decoder.layers.0.self_attention.linear_qkv.weight": (2 * 3 * 16, 48),
        "decoder.layers.0.self_attention.linear_qkv.bias": (2 * 3 * 16,),
        "decoder.layers.0.self_attention.linear_proj.weight": (48, 2 * 16),
        "decoder.layers.0.self_attention.linear_proj.bias": (48,),
        "decoder.layers.0.pre_mlp_layernorm.weight": (48,),
        "decoder.layers.0.mlp.linear_fc1.weight": (2 * 64, 48),  # SwiGLU: gate and up rows
        "decoder.layers.0.mlp.linear_fc1.bias": (2 * 64,),
        "decoder.layers.0.mlp.linear_fc2.weight": (48, 64),
        "decoder.layers.0.mlp.linear_fc2.bias": (48,),
    }
    assert result["restored_equal"]
    trained_end = result["train_losses"][-1]
    assert result["before"] < 4.5, result  # trained (untrained: ~5.6)
    assert result["before"] < result["after"] < 6.0, result  # pruning costs, the model is not destroyed
    finetune = result["finetune_losses"]
    assert len(finetune) == FINETUNE_ITERS and all(math.isfinite(loss) for loss in finetune)
    assert finetune[-1] < finetune[0], finetune  # training recovers from pruning
    assert finetune[0] > trained_end, (finetune, trained_end)


def test_prune_arguments_are_checked():
    from argparse import Namespace

    from examples.post_training import prune

    def args(**overrides):
        fields = dict(load="ckpt", tensor_model_parallel_size=1, pipeline_model_parallel_size=1, calib_size=8,
                      target_hidden_size=48, target_ffn_hidden_size=None, target_num_attention_heads=None)
        fields.update(overrides)
        return Namespace(**fields)

    prune._check_arguments(args())
    for overrides, message in (
        ({"load": None}, "needs --load"),
        ({"tensor_model_parallel_size": 2}, "--tensor-model-parallel-size 1"),
        ({"pipeline_model_parallel_size": 2}, "--pipeline-model-parallel-size 1"),
        ({"target_hidden_size": None}, "at least one of --target-hidden-size"),
        ({"calib_size": 0}, "--calib-size must be >= 1"),
    ):
        with pytest.raises(ValueError, match=message):
            prune._check_arguments(args(**overrides))


@pytest.mark.skipif(HAVE_TE or not modelopt_installed(),
                    reason="checks the message given where modelopt is installed and transformer-engine is not")
def test_modelopt_plugin_without_transformer_engine_says_what_it_needs(monkeypatch):
    from examples.post_training import prune
    from megatron.core import optional_deps

    monkeypatch.setattr(optional_deps, "have_modelopt", lambda: True)  # no need to import modelopt for the check
    with pytest.raises(RuntimeError, match="needs transformer-engine.*does not run on CPUs.*Drop --use-modelopt"):
        prune.check_pruning_available()


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_TE or not modelopt_installed(),
                    reason="modelopt's mcore_minitron plugin needs transformer-engine and nvidia-modelopt")
def test_modelopt_plugin_path_prunes_or_names_the_missing_upstream_modules():
    """`--use-modelopt-plugin` on a tiny GPT on the GPU: the plugin prunes to the targets where it imports against
    this megatron.core; where it does not, the error names the upstream modules, and they are indeed missing."""
    import importlib.util

    from examples.post_training import prune
    from megatron.core.post_training.prune import WidthPruningTarget
    from tests.unit_tests.post_training.prune import tiny_gpt

    missing = []
    for name in UPSTREAM_MODULES_OF_THE_PLUGIN:
        try:
            if importlib.util.find_spec(name) is None:
                missing.append(name)
        except ModuleNotFoundError:
            missing.append(name)
    model = tiny_gpt.tiny_gpt().cuda()
    batches = [tuple(t.cuda() for t in tiny_gpt.batch(step)) for step in range(2)]
    target = WidthPruningTarget(hidden_size=16, ffn_hidden_size=32, num_attention_heads=2)
    if missing:
        with pytest.raises(RuntimeError, match="does not import against this megatron.core"):
            prune.modelopt_minitron_prune(model, target, tiny_gpt.forward_loop(batches))
        return
    prune.modelopt_minitron_prune(model, target, tiny_gpt.forward_loop(batches))
    config = model.config
    assert (config.hidden_size, config.ffn_hidden_size, config.num_attention_heads) == (16, 32, 2)
    tokens, _, positions = batches[0]
    with torch.no_grad():
        assert torch.isfinite(model(tokens, positions)).all()
