"""A pretrain script written against upstream Megatron-LM (its import paths: `from megatron.training import
get_args, pretrain, ...`, `megatron.training.utils`, `megatron.core.utils.StragglerDetector`) runs unchanged and
trains exactly as `pretrain_gpt.py` on the same flags; importing `megatron.training` stays free."""

import json
import os
import runpy
import subprocess
import sys
import types

import pytest
import torch

from tests.unit_tests.multiprocess_harness import run_on_ranks

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

TINY_GPT = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 16 --micro-batch-size 2 "
    "--global-batch-size 8 --lr 1e-3 --mock-data --vocab-size 127 --make-vocab-size-divisible-by 64 "
    "--hidden-dropout 0 --attention-dropout 0 --num-workers 0 --log-interval 1 --eval-iters 0 --ckpt-format torch "
    "--train-iters 3"
)

# The import block of upstream's pretrain_gpt.py as users adapt it, verbatim.
UPSTREAM_IMPORTS = (
    "from megatron.training import get_args, get_timers, get_tokenizer, pretrain, print_rank_0, print_rank_last, "
    "is_last_rank, initialize_megatron, get_tensorboard_writer, get_wandb_writer, get_signal_handler, "
    "set_startup_timestamps\n"
    "from megatron.training.arguments import core_transformer_config_from_args\n"
    "from megatron.training.utils import get_batch_on_this_cp_rank, get_batch_on_this_tp_rank, "
    "get_blend_and_blend_per_split, is_first_or_last_pipeline_stage, average_losses_across_data_parallel_group, "
    "unwrap_model, print_rank_0\n"
    "from megatron.core.utils import StragglerDetector\n"
    "from megatron.core.enums import ModelType\n"
)

UPSTREAM_SCRIPT_BODY = '''
import time
from functools import partial

import torch

import pretrain_gpt
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.utils import get_attr_wrapped_model

stimer = StragglerDetector()


def model_provider(pre_process=True, post_process=True, vp_stage=None):
    args = get_args()
    print_rank_0("building GPT model ...")
    config = core_transformer_config_from_args(get_args())
    if args.transformer_impl == "transformer_engine":
        layer_spec = get_gpt_layer_with_transformer_engine_spec(
            args.num_experts, args.moe_grouped_gemm, args.qk_layernorm, args.multi_latent_attention)
    else:
        layer_spec = get_gpt_layer_local_spec(
            args.num_experts, args.moe_grouped_gemm, args.qk_layernorm, args.multi_latent_attention,
            normalization=args.normalization)
    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
        vp_stage=vp_stage,
    )


def get_batch(data_iterator, vp_stage=None):
    if not is_first_or_last_pipeline_stage(vp_stage):
        return None, None, None, None, None
    batch = get_batch_on_this_tp_rank(data_iterator)
    batch = get_batch_on_this_cp_rank(batch)
    return batch.values()


def per_token_loss_func(loss_mask, output_tensor):
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    reporting_loss = torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])
    return loss, num_tokens, {"lm loss": reporting_loss}


def first_tokens_masked_loss_func(loss_mask, output_tensor):
    # Upstream's loss over all but the first 3 positions of each sequence: under context parallelism the ranks
    # then hold different token counts (the first positions lie in rank 0's chunks).
    return per_token_loss_func(loss_mask * (POSITION_IDS >= 3), output_tensor)


def averaged_loss_func(loss_mask, output_tensor):
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask) / loss_mask.sum()
    averaged_loss = average_losses_across_data_parallel_group([loss])
    return loss, {"lm loss": averaged_loss[0]}


def forward_step(data_iterator, model):
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    with stimer(bdata=True):
        vp_stage = get_attr_wrapped_model(model, "vp_stage")
        tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator, vp_stage)
        global POSITION_IDS
        POSITION_IDS = position_ids
    timers("batch-generator").stop()
    with stimer:
        output_tensor = model(tokens, position_ids, attention_mask, labels=labels)
    return output_tensor, partial(LOSS_FUNC, loss_mask)


def train_valid_test_datasets_provider(train_val_test_num_samples):
    blend, blend_per_split = get_blend_and_blend_per_split(get_args())
    print_rank_0(f"> building train, validation, and test datasets (blend {blend}, per split {blend_per_split})")
    return pretrain_gpt.train_valid_test_datasets_provider(train_val_test_num_samples)


if __name__ == "__main__":
    set_startup_timestamps(program_start=time.time(), main_entry=time.time())
    train_valid_test_datasets_provider.is_distributed = True
    pretrain(
        train_valid_test_datasets_provider,
        model_provider,
        ModelType.encoder_or_decoder,
        forward_step,
        args_defaults={"tokenizer_type": "NullTokenizer"},
    )
'''


def upstream_script(loss_func_name):
    return UPSTREAM_IMPORTS + UPSTREAM_SCRIPT_BODY.replace("LOSS_FUNC", loss_func_name)


def _metrics_losses(path, field="lm loss"):
    return [json.loads(line)[field] for line in open(path).read().splitlines()]


def _upstream_script_and_pretrain_gpt_losses(workdir, loss_func_name, extra_flags, field="lm loss"):
    """(the upstream-style script's losses, pretrain_gpt.py's losses) on the same flags, on every rank."""
    import pretrain_gpt
    from megatron.core.enums import ModelType
    from megatron.training.training import pretrain

    rank = torch.distributed.get_rank()
    flags = f"{TINY_GPT} {extra_flags}".split()
    reference_metrics = os.path.join(workdir, f"reference_{loss_func_name}.jsonl")
    pretrain(pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider,
             ModelType.encoder_or_decoder, pretrain_gpt.forward_step,
             argv=flags + ["--metrics-file", reference_metrics])

    script = os.path.join(workdir, f"pretrain_custom_{loss_func_name}.py")
    if rank == 0:
        with open(script, "w") as stream:
            stream.write(upstream_script(loss_func_name))
    torch.distributed.barrier()
    script_metrics = os.path.join(workdir, f"script_{loss_func_name}.jsonl")
    saved_argv = sys.argv
    sys.argv = [script] + flags + ["--metrics-file", script_metrics]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        sys.argv = saved_argv
    torch.distributed.barrier()
    return _metrics_losses(script_metrics, field), _metrics_losses(reference_metrics, field)


@pytest.mark.parametrize("world_size", [1])
def test_upstream_script_trains_as_pretrain_gpt_on_one_rank(tmp_path, world_size):
    script, reference = run_on_ranks(world_size, _upstream_script_and_pretrain_gpt_losses, str(tmp_path),
                                     "per_token_loss_func", "")[0]
    assert len(reference) == 3 and reference[0] > 4.0  # ln(127) ~ 4.8 at the start
    assert script == reference  # same model, data, loss and reduction: bit for bit


@pytest.mark.parametrize("world_size", [2])
def test_upstream_script_trains_as_pretrain_gpt_with_tensor_and_data_parallelism(tmp_path, world_size):
    # TP2: every tensor-parallel rank reads the same batch without a broadcast.
    script, reference = run_on_ranks(world_size, _upstream_script_and_pretrain_gpt_losses, str(tmp_path / "tp"),
                                     "per_token_loss_func", "--tensor-model-parallel-size 2")[1]
    assert len(reference) == 3 and script == reference
    # DP2 with upstream's older (loss, {"lm loss": loss averaged over data-parallel ranks}) form: every microbatch
    # has the same token count, so the mean of means is the token-weighted mean pretrain_gpt.py reports.
    script, reference = run_on_ranks(world_size, _upstream_script_and_pretrain_gpt_losses, str(tmp_path / "dp"),
                                     "averaged_loss_func", "")[1]
    assert len(reference) == 3 and script == pytest.approx(reference, rel=1e-6)


def test_importing_megatron_training_loads_nothing_until_a_name_is_used():
    code = (
        "import sys, megatron.training\n"
        "print(sorted(m for m in sys.modules if m.startswith('megatron')), 'torch' in sys.modules)\n"
        "from megatron.training import get_args\n"
        "print(get_args.__module__)\n"
    )
    output = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert output.stdout.splitlines() == ["['megatron', 'megatron.training'] False", "megatron.training.global_state"]


def test_upstream_names_are_this_repositorys_implementations():
    import megatron.training
    from megatron.core.transformer.context_parallel import sequence_split
    from megatron.core import utils as core_utils
    from megatron.training import global_vars, initialize, model_config, utils
    from megatron.training.arguments import core_transformer_config_from_args

    namespace = {}
    exec(UPSTREAM_IMPORTS, namespace)
    assert namespace["get_args"] is global_vars.get_args
    assert namespace["get_timers"] is global_vars.get_timers
    assert namespace["get_tokenizer"] is global_vars.get_tokenizer
    assert namespace["initialize_megatron"] is initialize.initialize_megatron
    assert namespace["pretrain"] is utils.pretrain
    assert core_transformer_config_from_args is model_config.core_transformer_config_from_args
    assert namespace["unwrap_model"] is core_utils.unwrap_model
    batch = {"tokens": torch.arange(8).view(1, 8)}
    assert namespace["get_batch_on_this_cp_rank"](batch) is batch  # no context parallelism: the batch itself
    assert sequence_split.get_batch_on_this_cp_rank(batch, 2, 1)["tokens"].tolist() == [[2, 3, 4, 5]]
    assert "get_args" in dir(megatron.training)


def test_straggler_detector_measures_nothing_and_refuses_to_be_enabled():
    from megatron.core.utils import StragglerDetector

    stimer = StragglerDetector()
    with stimer(bdata=True) as inner:
        assert inner is stimer
    with stimer:
        pass
    stimer.configure(world=2, rank=0, mmcnt=1, enabled=False)
    assert stimer.configured and not stimer.enabled and stimer.report(total_flops=1.0, log_interval=10) is False
    with pytest.raises(ValueError, match="straggler detection is not available"):
        stimer.configure(world=2, rank=0, enabled=True)
    with pytest.raises(KeyError):  # exceptions inside the block propagate
        with stimer(bdata=True):
            raise KeyError("batch")


def test_names_without_meaning_here(monkeypatch):
    from megatron.training import global_state
    from megatron.training import (get_one_logger, get_signal_handler, get_tensorboard_writer, get_wandb_writer,
                                   inprocess_restart, pretrain, set_startup_timestamps)

    def run(*args, **kwargs):
        return "ran"

    assert get_one_logger() is None
    assert set_startup_timestamps(program_start=1.0, main_entry=2.0) is None
    wrapped, store = inprocess_restart.maybe_wrap_for_inprocess_restart(run)
    assert wrapped is run and store is None
    with pytest.raises(ValueError, match=r"pretrain\(store=...\) is not supported"):
        pretrain(None, None, None, None, store=object())
    with pytest.raises(RuntimeError, match="--exit-signal-handler"):
        get_signal_handler()  # installed only while pretrain()'s loop runs with --exit-signal-handler
    monkeypatch.setattr(global_state, "_ARGS", types.SimpleNamespace(tensorboard_dir=None, wandb_project=""))
    assert get_tensorboard_writer() is None and get_wandb_writer() is None
    # With the flags, the training log's writers from the start of training (test_global_vars.py); none before.
    monkeypatch.setattr(global_state, "_ARGS", types.SimpleNamespace(tensorboard_dir="/runs/a", wandb_project="p"))
    assert get_tensorboard_writer() is None and get_wandb_writer() is None
    # Upstream's other helpers import from megatron.training.utils (each tested in test_utils.py).
    exec("from megatron.training.utils import append_to_progress_log, calc_params_l2_norm, "
         "get_ltor_masks_and_position_ids, logical_and_across_model_parallel_group, print_params_min_max_norm, "
         "report_memory, update_use_dist_ckpt", {})
    with pytest.raises(ImportError):
        exec("from megatron.training import no_such_name", {})


def test_batch_and_blend_helpers(monkeypatch):
    from megatron.training import global_state
    from megatron.training.utils import get_batch_on_this_tp_rank, get_blend_and_blend_per_split

    monkeypatch.setattr(global_state, "_ARGS", types.SimpleNamespace(device=torch.device("cpu")))
    sample = {"tokens": torch.ones(2, 4, dtype=torch.long), "labels": torch.zeros(2, 4, dtype=torch.long),
              "loss_mask": torch.ones(2, 4), "position_ids": torch.arange(4).repeat(2, 1),
              "dataset_id": torch.zeros(2)}
    batch = get_batch_on_this_tp_rank(iter([sample]))
    assert list(batch) == ["tokens", "labels", "loss_mask", "attention_mask", "position_ids"]
    assert batch["attention_mask"] is None and torch.equal(batch["position_ids"], sample["position_ids"])
    with pytest.raises(KeyError, match="'loss_mask'"):
        get_batch_on_this_tp_rank(iter([{"tokens": sample["tokens"], "labels": sample["labels"],
                                         "position_ids": sample["position_ids"]}]))

    def data_args(data_path=None, train=None, valid=None, test=None):
        return types.SimpleNamespace(data_path=data_path, train_data_path=train, valid_data_path=valid,
                                     test_data_path=test)

    assert get_blend_and_blend_per_split(data_args()) == (None, None)
    assert get_blend_and_blend_per_split(data_args(["0.3", "a", "0.7", "b"])) == ((["a", "b"], [0.3, 0.7]), None)
    assert get_blend_and_blend_per_split(data_args(train=["t"], test=["x", "y"])) == (
        None, [(["t"], None), None, (["x", "y"], None)])


def _script_losses_and_grad_norms(workdir, loss_func_name, extra_flags):
    """The upstream-style script's (lm loss, grad norm) per iteration, on every rank."""
    script = os.path.join(workdir, "pretrain_custom.py")
    if torch.distributed.get_rank() == 0:
        os.makedirs(workdir, exist_ok=True)
        with open(script, "w") as stream:
            stream.write(upstream_script(loss_func_name))
    torch.distributed.barrier()
    metrics = os.path.join(workdir, "metrics.jsonl")
    saved_argv = sys.argv
    sys.argv = [script] + f"{TINY_GPT} {extra_flags}".split() + ["--metrics-file", metrics]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        sys.argv = saved_argv
    torch.distributed.barrier()
    return list(zip(_metrics_losses(metrics), _metrics_losses(metrics, "grad norm")))


@pytest.mark.parametrize("world_size", [2])
def test_upstream_loss_function_under_context_parallelism_is_the_whole_sequences_mean(tmp_path, world_size):
    """CP2 on two ranks against one rank: an upstream-style loss function returns this rank's sum and token count
    of each sequence's share, here uneven between the ranks (the first positions are masked); the schedule
    divides by the whole sequence's count, so loss and grad norm are the one-rank run's."""
    (one_rank,) = run_on_ranks(1, _script_losses_and_grad_norms, str(tmp_path / "cp1"),
                               "first_tokens_masked_loss_func", "")
    context_parallel = run_on_ranks(world_size, _script_losses_and_grad_norms, str(tmp_path / "cp2"),
                                    "first_tokens_masked_loss_func", "--context-parallel-size 2")[1]
    assert len(one_rank) == 3
    for (loss, grad_norm), (cp_loss, cp_grad_norm) in zip(one_rank, context_parallel):
        assert cp_loss == pytest.approx(loss, rel=1e-5) and cp_grad_norm == pytest.approx(grad_norm, rel=1e-5)


def test_upstreams_data_iterator_builders_import_from_training():
    """Upstream scripts with their own loop import the data builders from `megatron.training.training`."""
    from megatron.training import data_iterators, training

    assert training.build_train_valid_test_data_iterators is data_iterators.build_train_valid_test_data_iterators
    assert training.get_train_valid_test_num_samples is data_iterators.get_train_valid_test_num_samples
    assert training.cyclic_iter is data_iterators.cyclic_iter
