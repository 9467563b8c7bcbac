"""Megatron-FSDP inside Megatron-Core: a GPT trained through `FullyShardedDataParallel` and the Megatron-FSDP
optimizer equals the same GPT trained through Megatron's DDP (same TP / PP layout), step by step: reported
losses, grad norms and zero counts, and the final weights.

Covered per world size (each rank function trains every case against one DDP reference):
- DP=2 and DP=3: ZeRO-0..3;
- world 4: TP2xDP2 with and without sequence parallelism, PP2xDP2 (1F1B, 4 microbatches, tied embedding split
  over the two stages) at ZeRO-0..3, HSDP and HFSDP (2 instances x DP2), meta-device init (the eager initial
  weights, exactly) with TP2 and PP2;
- world 8: TP2xPP2xDP2;
- `pretrain()` with `--use-megatron-fsdp` against the DDP run of the same command line.
"""

import json
import types

import pytest
import torch

from tests.unit_tests.multiprocess_harness import run_on_ranks
from tests.unit_tests.pipeline_parallel.test_gpt_pipeline import _forward_step

VOCAB, SEQ, MICRO_BATCH, HIDDEN, HEADS = 64, 16, 2, 32, 4
SEED = 1234
STEPS = 3
LOSS_TOLERANCE = 1e-5
# Final weights after STEPS Adam steps: DDP and FSDP reduce gradients in different orders (all-reduce vs
# reduce-scatter), so they differ by float rounding, which Adam's normalisation can magnify slightly.
WEIGHT_TOLERANCE = 1e-5
# Exact zero gradients are mostly structural (embedding rows of absent tokens, vocabulary padding); a sum of
# nonzero terms can also round to exactly zero in one reduction order and not in the other.
NUM_ZEROS_SLACK = 2


def _layout(tp=1, pp=1, sp=False, instances=1):
    return {"tp": tp, "pp": pp, "sp": sp, "instances": instances}


_groups_built_for = None  # the model-parallel sizes parallel_state was last initialised with here


def _build(layout, meta=False, num_layers=2, fp16=False):
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    global _groups_built_for
    sizes = dict(tensor_model_parallel_size=layout["tp"], pipeline_model_parallel_size=layout["pp"],
                 num_distributed_optimizer_instances=layout["instances"])
    # Consecutive runs of one layout train on the same groups (the harness destroys them after each task).
    if not (parallel_state.model_parallel_is_initialized() and _groups_built_for == sizes):
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(**sizes)
        _groups_built_for = sizes
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    config = TransformerConfig(
        num_layers=num_layers, hidden_size=HIDDEN, num_attention_heads=HEADS, hidden_dropout=0.0,
        attention_dropout=0.0, init_seed=SEED, tensor_model_parallel_size=layout["tp"],
        pipeline_model_parallel_size=layout["pp"], sequence_parallel=layout["sp"], init_model_with_meta_device=meta,
        fp16=fp16, params_dtype=torch.float16 if fp16 else torch.float32,
    )
    return GPTModel(config, vocab_size=VOCAB, max_sequence_length=SEQ,
                    pre_process=parallel_state.is_pipeline_first_stage(),
                    post_process=parallel_state.is_pipeline_last_stage(), share_embeddings_and_output_weights=True)


def _wrap(model, strategy, instances=1, outer="no_shard", param_offload=False):
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        FullyShardedDataParallel,
    )

    if strategy is None:
        return DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    ddp_config = DistributedDataParallelConfig(
        use_megatron_fsdp=True, use_distributed_optimizer=True, overlap_grad_reduce=True,
        overlap_param_gather=True, data_parallel_sharding_strategy=strategy, outer_dp_sharding_strategy=outer,
        num_distributed_optimizer_instances=instances, megatron_fsdp_param_offload=param_offload,
    )
    return FullyShardedDataParallel(model.config, ddp_config, model)


def _batches(step, num_microbatches):
    from megatron.core import parallel_state

    dp_rank = parallel_state.get_data_parallel_rank(with_context_parallel=True)
    generator = torch.Generator().manual_seed(1000 * step + dp_rank)
    batches = []
    for _ in range(num_microbatches):
        stream = torch.randint(0, VOCAB // 2, (MICRO_BATCH, SEQ + 1), generator=generator)
        batches.append({"tokens": stream[:, :-1].contiguous(), "labels": stream[:, 1:].contiguous(),
                        "loss_mask": (torch.rand(MICRO_BATCH, SEQ, generator=generator) > 0.2).float(),
                        "position_ids": torch.arange(SEQ).expand(MICRO_BATCH, SEQ).contiguous()})
    return batches


def _full_weights(chunk):
    """Parameter name (of the GPT) -> this rank's full (TP-local) weights."""
    if hasattr(chunk, "gathered_parameters"):
        with chunk.gathered_parameters() as model:
            return {name: param.detach().clone() for name, param in model.named_parameters()}
    return {name: param.detach().clone() for name, param in chunk.module.named_parameters()}


def _train(layout, strategy=None, num_microbatches=2, outer="no_shard", meta=False, clip_grad=1.0,
           param_offload=False):
    """Train STEPS steps; returns losses, grad norms, zero counts, initial and final weights of this rank."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.training.model_setup import install_schedule_hooks
    from megatron.training.training import reduce_reported_loss

    chunk = _wrap(_build(layout, meta=meta), strategy, layout["instances"], outer, param_offload)
    if param_offload:  # the shards the optimizer steps come from the offload placement (host memory)
        assert all(group.offload is not None for group in chunk.module.groups)
    initial = _full_weights(chunk)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(lr=1e-3, clip_grad=clip_grad, log_num_zeros_in_grad=True, weight_decay=0.01), [chunk])
    install_schedule_hooks([chunk], optimizer, types.SimpleNamespace(fp16=False))
    result = {"losses": [], "grad_norms": [], "num_zeros": [], "initial": initial}
    for step in range(STEPS):
        chunk.zero_grad_buffer()
        optimizer.zero_grad()
        reports = get_forward_backward_func()(
            forward_step_func=_forward_step, data_iterator=iter(_batches(step, num_microbatches)), model=[chunk],
            num_microbatches=num_microbatches, seq_length=SEQ, micro_batch_size=MICRO_BATCH)
        success, grad_norm, num_zeros = optimizer.step()
        assert success
        result["losses"].append(reduce_reported_loss(reports, torch.device("cpu")))
        result["grad_norms"].append(float(grad_norm))
        result["num_zeros"].append(float(num_zeros))
    result["final"] = _full_weights(chunk)
    result["state_bytes"] = chunk.state_bytes() if hasattr(chunk, "state_bytes") else None
    return result


def _differences(case, reference):
    worst = max((case["final"][name] - value).abs().max().item() for name, value in reference["final"].items())
    return {
        "loss": max(abs(a - b) for a, b in zip(case["losses"], reference["losses"])),
        "grad_norm": max(abs(a - b) / b for a, b in zip(case["grad_norms"], reference["grad_norms"])),
        "num_zeros": max(abs(a - b) for a, b in zip(case["num_zeros"], reference["num_zeros"])),
        "weights": worst,
        "same_names": sorted(case["final"]) == sorted(reference["final"]),
        "initial_equal": all(torch.equal(case["initial"][n], v) for n, v in reference["initial"].items()),
    }


def _compare_cases(cases):
    """cases: {label: (layout, train kwargs)}; each label's run against DDP of the same layout."""
    references, results = {}, {}
    for label, (layout, kwargs) in cases.items():
        key = (tuple(sorted(layout.items())), kwargs.get("num_microbatches", 2))
        if key not in references:
            references[key] = _train(layout, None, num_microbatches=kwargs.get("num_microbatches", 2))
        case = _train(layout, **kwargs)
        results[label] = _differences(case, references[key])
        results[label]["state_bytes"] = case["state_bytes"]
    return results


def _assert_all_match(results_per_rank):
    for rank, results in enumerate(results_per_rank):
        for label, diff in results.items():
            context = f"rank {rank}, {label}: {diff}"
            assert diff["same_names"], context
            assert diff["initial_equal"], context
            assert diff["loss"] < LOSS_TOLERANCE, context
            assert diff["grad_norm"] < 1e-5, context
            assert diff["num_zeros"] <= NUM_ZEROS_SLACK, context
            assert diff["weights"] < WEIGHT_TOLERANCE, context


STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def _data_parallel_cases():
    cases = {strategy: (_layout(), {"strategy": strategy}) for strategy in STRATEGIES}
    # --megatron-fsdp-param-offload: ZeRO-3 with its shards in host memory.
    cases["optim_grads_params_param_offload"] = (_layout(), {"strategy": "optim_grads_params", "param_offload": True})
    return _compare_cases(cases)


@pytest.mark.parametrize("world_size", [2, 3])
def test_data_parallel_every_strategy_matches_ddp(world_size):
    _assert_all_match(run_on_ranks(world_size, _data_parallel_cases))


def _fp16_overflow_step():
    """fp16 under ZeRO-3 with a loss scale that overflows the fp16 gradients: the step is skipped on every rank,
    the weights stay as they were and the dynamic scale backs off."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.training.model_setup import install_schedule_hooks

    chunk = _wrap(_build(_layout(), fp16=True), "optim_grads_params")
    before = _full_weights(chunk)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(lr=1e-3, fp16=True, params_dtype=torch.float16, initial_loss_scale=2.0**40, hysteresis=1),
        [chunk])
    install_schedule_hooks([chunk], optimizer, types.SimpleNamespace(fp16=True))
    chunk.zero_grad_buffer()
    optimizer.zero_grad()
    get_forward_backward_func()(forward_step_func=_forward_step, data_iterator=iter(_batches(0, 2)), model=[chunk],
                                num_microbatches=2, seq_length=SEQ, micro_batch_size=MICRO_BATCH)
    success, grad_norm, _ = optimizer.step()
    after = _full_weights(chunk)
    return {"success": success, "grad_norm": grad_norm, "loss_scale": float(optimizer.get_loss_scale()),
            "unchanged": all(torch.equal(before[name], after[name]) for name in before)}


@pytest.mark.parametrize("world_size", [2])
def test_fp16_overflow_skips_the_step_on_every_rank(world_size):
    for result in run_on_ranks(world_size, _fp16_overflow_step):
        assert result == {"success": False, "grad_norm": None, "loss_scale": 2.0**39, "unchanged": True}


def _world_four_cases():
    cases = {
        "tp2 z3": (_layout(tp=2), {"strategy": "optim_grads_params"}),
        "tp2 sp z3": (_layout(tp=2, sp=True), {"strategy": "optim_grads_params"}),
        "tp2 sp z1": (_layout(tp=2, sp=True), {"strategy": "optim"}),
        "hsdp z3": (_layout(instances=2), {"strategy": "optim_grads_params", "outer": "no_shard"}),
        "hfsdp z3": (_layout(instances=2), {"strategy": "optim_grads_params", "outer": "optim"}),
    }
    for strategy in STRATEGIES:
        cases[f"pp2 {strategy}"] = (_layout(pp=2), {"strategy": strategy, "num_microbatches": 4})
    # Meta-device init (materialised unit by unit, each rank keeping its shard): the eager initial weights
    # (`initial_equal`, exact), and then the same training.
    cases["meta tp2 z3"] = (_layout(tp=2), {"strategy": "optim_grads_params", "meta": True})
    cases["meta pp2 z2"] = (_layout(pp=2), {"strategy": "optim_grads", "meta": True, "num_microbatches": 4})
    return _compare_cases(cases)


@pytest.mark.parametrize("world_size", [4])
def test_tensor_pipeline_hybrid_sharding_and_meta_init_match_ddp(world_size):
    _assert_all_match(run_on_ranks(world_size, _world_four_cases))


def _world_eight_cases():
    # One case: eight ranks share two cores here, so every extra run costs several seconds.
    return _compare_cases({
        "tp2 pp2 sp z3": (_layout(tp=2, pp=2, sp=True), {"strategy": "optim_grads_params", "num_microbatches": 3}),
    })


@pytest.mark.parametrize("world_size", [8])
def test_tensor_and_pipeline_parallel_world_eight_matches_ddp(world_size):
    _assert_all_match(run_on_ranks(world_size, _world_eight_cases))


PRETRAIN_ARGS = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
    "--micro-batch-size 2 --global-batch-size 8 --lr 1e-3 --train-iters 4 --mock-data --vocab-size 127 "
    "--make-vocab-size-divisible-by 64 --hidden-dropout 0 --attention-dropout 0 --num-workers 0 --log-interval 2 "
    "--eval-iters 0 --ckpt-format torch --log-num-zeros-in-grad"
)


def _pretrain_losses(workdir, name, extra_args):
    import pretrain_gpt
    from megatron.core.enums import ModelType
    from megatron.training.training import pretrain

    metrics = f"{workdir}/{name}.jsonl"
    pretrain(pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider,
             ModelType.encoder_or_decoder, pretrain_gpt.forward_step,
             argv=f"{PRETRAIN_ARGS} --metrics-file {metrics} {extra_args}".split())
    return metrics


def _pretrain_ddp_and_megatron_fsdp(workdir):
    ddp = _pretrain_losses(workdir, "ddp", "")
    fsdp = _pretrain_losses(workdir, "fsdp", "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params")
    return ddp, fsdp


@pytest.mark.parametrize("world_size", [2])
def test_pretrain_with_use_megatron_fsdp_matches_ddp(tmp_path, world_size):
    ddp_path, fsdp_path = run_on_ranks(world_size, _pretrain_ddp_and_megatron_fsdp, str(tmp_path))[-1]
    ddp = [json.loads(line) for line in open(ddp_path)]
    fsdp = [json.loads(line) for line in open(fsdp_path)]
    assert [record["iteration"] for record in fsdp] == [1, 2, 3, 4]
    for ddp_record, fsdp_record in zip(ddp, fsdp, strict=True):
        assert abs(fsdp_record["lm loss"] - ddp_record["lm loss"]) < LOSS_TOLERANCE
        assert fsdp_record["grad norm"] == pytest.approx(ddp_record["grad norm"], rel=1e-5)
    # Per-rank state on the memory line: ZeRO-3 over DP=2 holds half of DDP's weights and gradients (up to the
    # padding of each group to a multiple of DP).
    for kind in ("params-bytes", "grads-bytes"):
        assert 0.5 <= fsdp[-1][kind] / ddp[-1][kind] < 0.51, kind


@pytest.mark.parametrize("extra, message", [
    ("--megatron-fsdp-param-offload", "--megatron-fsdp-param-offload offloads ZeRO-3's shards: it needs "
                                      "--use-megatron-fsdp with --data-parallel-sharding-strategy optim_grads_params"),
    ("--use-megatron-fsdp --data-parallel-sharding-strategy optim --megatron-fsdp-param-offload",
     "it needs --use-megatron-fsdp with --data-parallel-sharding-strategy optim_grads_params"),
    ("--use-megatron-fsdp --megatron-fsdp-param-offload --use-precision-aware-optimizer --optimizer-cpu-offload",
     "--megatron-fsdp-param-offload does not work with --optimizer-cpu-offload"),
])
def test_param_offload_flag_rules(extra, message, monkeypatch):
    from tests.unit_tests.training.test_arguments import validated

    with pytest.raises(ValueError, match=message):
        validated(extra, monkeypatch=monkeypatch)


def test_param_offload_reaches_the_configs(monkeypatch):
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import _package_ddp_config
    from megatron.training.model_config import ddp_config_from_args
    from tests.unit_tests.training.test_arguments import validated

    args = validated("--use-megatron-fsdp --megatron-fsdp-param-offload", monkeypatch=monkeypatch)
    ddp_config = ddp_config_from_args(args)
    assert ddp_config.megatron_fsdp_param_offload and _package_ddp_config(ddp_config).param_offload
    without_offload = ddp_config_from_args(validated("--use-megatron-fsdp", monkeypatch=monkeypatch))
    assert not without_offload.megatron_fsdp_param_offload
    with pytest.raises(ValueError, match=r"\(--megatron-fsdp-param-offload\) offloads ZeRO-3's shards"):
        DistributedDataParallelConfig(megatron_fsdp_param_offload=True)


def _sharded_state_dict_round_trip(directory):
    """Upstream's own-loop checkpoint calls on a ZeRO-3 chunk: save `model.sharded_state_dict()`, then
    `model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), directory))`."""
    from megatron.core import dist_checkpointing

    saved = _wrap(_build(_layout()), "optim_grads_params")
    dist_checkpointing.save(saved.sharded_state_dict(), directory)
    target = _wrap(_build(_layout()), "optim_grads_params")
    zeros = {name: torch.zeros_like(value.pieces[0][1]) if value.pieces else value
             for name, value in target.sharded_state_dict().items()}
    target.load_state_dict(zeros)
    zeroed = all(not weight.any() for weight in _full_weights(target).values())
    target.load_state_dict(dist_checkpointing.load(target.sharded_state_dict(), directory))
    expected, restored = _full_weights(saved), _full_weights(target)
    return zeroed, set(expected) == set(restored) and all(torch.equal(expected[k], restored[k]) for k in expected)


@pytest.mark.parametrize("world_size", [2])
def test_sharded_state_dict_saves_and_loads_through_dist_checkpointing(tmp_path, world_size):
    for zeroed, restored in run_on_ranks(world_size, _sharded_state_dict_round_trip, str(tmp_path / "ckpt")):
        assert zeroed and restored
