"""FSDP2 (`TorchFullyShardedDataParallel`): gradients equal the unsharded full-batch ones, the DDP interface
the training loop uses works, unsupported settings are refused clearly, and training with TP, SP and PP
reproduces Megatron DDP's losses."""

import json
import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from tests.unit_tests.multiprocess_harness import run_on_ranks

VOCAB_SIZE = 64
SEQ_LENGTH = 8
MICRO_BATCH_SIZE = 2
NUM_MICROBATCHES = 3


def _config(**overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    settings = dict(num_layers=2, hidden_size=16, num_attention_heads=2, hidden_dropout=0.0, attention_dropout=0.0,
                    init_seed=7)
    return TransformerConfig(**{**settings, **overrides})


def _gpt(config, tied=False):
    from megatron.core.models.gpt.gpt_model import GPTModel

    return GPTModel(config, vocab_size=VOCAB_SIZE, max_sequence_length=SEQ_LENGTH,
                    share_embeddings_and_output_weights=tied)


def _microbatch(index):
    generator = torch.Generator().manual_seed(100 + index)
    stream = torch.randint(0, VOCAB_SIZE, (MICRO_BATCH_SIZE, SEQ_LENGTH + 1), generator=generator)
    positions = torch.arange(SEQ_LENGTH).expand(MICRO_BATCH_SIZE, SEQ_LENGTH)
    return stream[:, :-1], positions, stream[:, 1:]


def _mean_loss(model, index):
    tokens, positions, labels = _microbatch(index)
    return model(tokens, positions, labels=labels).mean()


def _wrap(module, config=None, **kwargs):
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.torch_fully_sharded_data_parallel import TorchFullyShardedDataParallel

    return TorchFullyShardedDataParallel(config or module.config, kwargs.pop("ddp_config", DistributedDataParallelConfig()),
                                         module, **kwargs)


def _refusals():
    from megatron.core.distributed import DistributedDataParallelConfig

    cases = [
        (lambda: _wrap(_gpt(_config(), tied=True)), "--untie-embeddings-and-output-weights"),
        (lambda: _wrap(_gpt(_config()), config=_config(fp16=True, params_dtype=torch.float16)),
         "does not support --fp16"),
        (lambda: _wrap(_gpt(_config()), ddp_config=DistributedDataParallelConfig(use_distributed_optimizer=True)),
         "drop --use-distributed-optimizer"),
        (lambda: _wrap(_gpt(_config()), ddp_config=DistributedDataParallelConfig(use_megatron_fsdp=True)),
         "--use-megatron-fsdp"),
    ]
    with torch.device("meta"):
        meta_model = _gpt(_config())
    cases.append((lambda: _wrap(meta_model), "is on the meta device; drop --init-model-with-meta-device"))
    messages = []
    for build, expected in cases:
        try:
            build()
            messages.append(f"no error, expected {expected!r}")
        except ValueError as error:
            messages.append(expected if expected in str(error) else str(error))
    return messages, [expected for _, expected in cases]


def _interface_and_gradients(reshard_after_forward, refusals):
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.optimizer.clip_grads import count_zeros_fp32, get_grad_norm_fp32

    parallel_state.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    reference = _gpt(_config())
    model = _gpt(_config())
    wrapped = _wrap(model, reshard_after_forward=reshard_after_forward)
    names = [name for name, _ in reference.named_parameters()]

    # Every parameter is one DTensor sharded on dim 0 over the data-parallel mesh; Megatron's attributes survive.
    assert len(wrapped.fsdp_units) == 2 + 1  # two TransformerLayers and the embedding
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor) and param.placements == (Shard(0),), name
    assert model.output_layer.weight.is_embedding_or_output_parameter
    assert model.embedding.word_embeddings.weight.is_embedding_or_output_parameter
    full_state = {key: value.full_tensor() for key, value in wrapped.state_dict().items()}
    for name, param in reference.named_parameters():
        assert torch.equal(full_state[name], param.detach()), name

    # Per-rank state: the shards of all ranks add up to the whole model, exactly.
    model_bytes = sum(param.numel() * param.element_size() for param in reference.parameters())
    held = torch.tensor([wrapped.state_bytes()["params_bytes"]], dtype=torch.float64)
    dist.all_reduce(held)
    assert held.item() == model_bytes and wrapped.state_bytes()["grads_bytes"] == 0

    # Gradient accumulation under no_sync over NUM_MICROBATCHES, reduce-scatter on the last one, equals the
    # full-batch gradient of the unsharded model over every rank's microbatches.
    indices = [rank * NUM_MICROBATCHES + m for m in range(NUM_MICROBATCHES)]
    wrapped.zero_grad_buffer()
    with wrapped.no_sync():
        for index in indices[:-1]:
            (_mean_loss(wrapped, index) / NUM_MICROBATCHES).backward()
        try:
            wrapped.finish_grad_sync()
            finish_inside_no_sync = "no error"
        except RuntimeError as error:
            finish_inside_no_sync = str(error)
    assert "inside no_sync()" in finish_inside_no_sync
    (_mean_loss(wrapped, indices[-1]) / NUM_MICROBATCHES).backward()
    wrapped.start_grad_sync()
    wrapped.finish_grad_sync()
    total = sum(_mean_loss(reference, index) for index in range(NUM_MICROBATCHES * world_size))
    (total / (NUM_MICROBATCHES * world_size)).backward()
    reference_grads = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        assert isinstance(param.grad, DTensor), name
        torch.testing.assert_close(param.grad.full_tensor(), reference_grads[name].grad, rtol=1e-5, atol=1e-7,
                                   msg=lambda m: f"{name}: {m}")
    grads_bytes = torch.tensor([wrapped.state_bytes()["grads_bytes"]], dtype=torch.float64)
    dist.all_reduce(grads_bytes)
    assert grads_bytes.item() == model_bytes

    # Grad norm and zero count over DTensor shards equal those of the same gradients gathered whole.
    grads = [param.grad for param in model.parameters()]
    full_grads = [grad.full_tensor() for grad in grads]
    full_grads[0][:3] = 0.0
    with torch.no_grad():
        grads[0].to_local().copy_(full_grads[0].chunk(world_size)[rank])
    expected_norm = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in full_grads])).item()
    assert get_grad_norm_fp32(grads, 2.0, []) == pytest.approx(expected_norm, rel=1e-6)
    assert get_grad_norm_fp32(grads, float("inf"), []) == max(g.abs().max().item() for g in full_grads)
    assert count_zeros_fp32(grads, []) == sum((g == 0).sum().item() for g in full_grads)

    before = [grad.to_local().clone() for grad in grads]
    wrapped.scale_gradients(0.25)
    for grad, old in zip(grads, before, strict=True):
        torch.testing.assert_close(grad.to_local(), old * 0.25, rtol=0, atol=0)
    wrapped.zero_grad_buffer()
    assert all(param.grad is None for param in model.parameters())

    # Full (unsharded) tensors load as this rank's shards; DTensors load as they are.
    other = _wrap(_gpt(_config(init_seed=99)))
    other.load_state_dict(full_state)
    for key, value in other.state_dict().items():
        assert torch.equal(value.full_tensor(), full_state[key]), key
    other.load_state_dict(wrapped.state_dict())
    mismatched = dict(full_state, **{names[0]: torch.zeros(3)})
    try:
        other.load_state_dict(mismatched)
        shape_error = "no error"
    except ValueError as error:
        shape_error = str(error)
    assert f"{names[0]} has shape (3,)" in shape_error
    return _refusals() if refusals else None


@pytest.mark.parametrize("world_size", [2])
def test_gradients_interface_and_refusals(world_size):
    # The refusals do not depend on reshard_after_forward: the first run checks them.
    for reshard_after_forward, refusals in ((True, True), (False, False)):
        for result in run_on_ranks(world_size, _interface_and_gradients, reshard_after_forward, refusals):
            if refusals:
                messages, expected = result
                assert messages == expected


# ---- loading full (unsharded) state dicts -------------------------------------------------------------------
class _UnevenModel(torch.nn.Module):
    """First dims of 5, 7 and 1: over 2 or 3 ranks the last shards are shorter or empty."""

    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.linear = torch.nn.Linear(3, 5)
        self.embedding = torch.nn.Embedding(7, 2)
        self.scale = torch.nn.Parameter(torch.randn(1, 4))


def _full_state_round_trip(cpu_offload):
    """Local shards of a model loaded from another FSDP2 model's full state dict, and those of that model."""
    from megatron.core.distributed import DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(use_torch_fsdp2=True, torch_fsdp2_cpu_offload=cpu_offload)
    source = _wrap(_UnevenModel(seed=1), config=_config(), ddp_config=ddp_config, fsdp_unit_modules=[torch.nn.Linear])
    loaded = _wrap(_UnevenModel(seed=2), config=_config(), ddp_config=ddp_config, fsdp_unit_modules=[torch.nn.Linear])
    full_state = {key: value.full_tensor() for key, value in source.state_dict().items()}
    before = {name: param.to_local().data_ptr() for name, param in loaded.module.named_parameters()}
    loaded.load_state_dict(full_state)
    # Loaded in place: the parameters FSDP2 offloaded (or not) are the ones holding the values.
    assert before == {name: param.to_local().data_ptr() for name, param in loaded.module.named_parameters()}
    local = {name: param.to_local().detach().clone() for name, param in loaded.module.named_parameters()}
    expected = {name: param.to_local().detach().clone() for name, param in source.module.named_parameters()}
    return local, expected


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_full_state_dict_loads_as_fsdp2_shards(world_size):
    for cpu_offload in (False, True):
        for rank, (local, expected) in enumerate(run_on_ranks(world_size, _full_state_round_trip, cpu_offload)):
            assert local.keys() == expected.keys()
            for name, shard in local.items():
                assert shard.shape == expected[name].shape and torch.equal(shard, expected[name]), (rank, name)
            if world_size == 3:  # scale (1 row) lives on rank 0 only; embedding (7 rows) splits 3, 3, 1
                assert local["scale"].shape[0] == (1 if rank == 0 else 0)
                assert local["embedding.weight"].shape[0] == (3, 3, 1)[rank]


def _load_over_host_shards_of_a_cuda_mesh():
    """What --torch-fsdp2-cpu-offload makes on a GPU machine: a "cuda" mesh whose DTensors keep their local
    tensors in host memory. Loading a full tensor must only ever touch this rank's piece, on the host."""
    from types import SimpleNamespace

    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    from megatron.core.distributed.torch_fully_sharded_data_parallel import TorchFSDP2

    rank, world_size = dist.get_rank(), dist.get_world_size()
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cuda", mesh=torch.arange(world_size, dtype=torch.int))
    full = torch.arange(5 * 3, dtype=torch.float64).reshape(5, 3)  # 5 rows over 2 ranks: 3 and 2
    expected = full.chunk(world_size)[rank].float()
    host_shard = torch.zeros_like(expected)
    spec = DTensorSpec(mesh, (Shard(0),), TensorMeta(full.shape, full.stride(), torch.float32))
    module = torch.nn.Module()
    module.weight = torch.nn.Parameter(DTensor(host_shard, spec, requires_grad=False))
    TorchFSDP2.load_state_dict(SimpleNamespace(module=module), {"weight": full})
    return module.weight.to_local().device.type, torch.equal(module.weight.to_local(), expected)


@pytest.mark.parametrize("world_size", [2])
def test_full_state_dict_loads_into_host_shards_of_a_cuda_mesh(world_size):
    assert run_on_ranks(world_size, _load_over_host_shards_of_a_cuda_mesh) == [("cpu", True)] * world_size


TINY_GPT = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 16 --micro-batch-size 2 "
    "--global-batch-size 8 --train-iters 4 --lr 5e-3 --lr-warmup-iters 1 --mock-data --vocab-size 127 "
    "--make-vocab-size-divisible-by 64 --hidden-dropout 0 --attention-dropout 0 --num-workers 0 --log-interval 1 "
    "--eval-iters 0 --ckpt-format torch_dist --untie-embeddings-and-output-weights --log-num-zeros-in-grad"
)


def _pretrain_metrics(workdir, runs):
    """{run name: {metric: [value per iteration]}} of `pretrain()` with each run's extra flags."""
    import pretrain_gpt
    from megatron.core.enums import ModelType
    from megatron.training.training import pretrain

    metrics = {}
    for name, extra in runs.items():
        metrics_file = os.path.join(workdir, f"{name}.jsonl")
        argv = f"{TINY_GPT} --metrics-file {metrics_file} {extra}".split()
        pretrain(pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider,
                 ModelType.encoder_or_decoder, pretrain_gpt.forward_step, argv=argv)
        dist.barrier()
        with open(metrics_file) as stream:
            records = [json.loads(line) for line in stream]
        metrics[name] = {key: [record[key] for record in records] for key in ("lm loss", "grad norm", "num-zeros")}
    return metrics


@pytest.mark.parametrize("world_size", [4])
def test_fsdp2_with_tensor_sequence_and_pipeline_parallelism_matches_ddp(tmp_path, world_size):
    runs = {
        "ddp_tp2": "--tensor-model-parallel-size 2",
        "fsdp2_tp2_sp": "--tensor-model-parallel-size 2 --sequence-parallel --use-torch-fsdp2",
        "ddp_pp2": "--pipeline-model-parallel-size 2",
        "fsdp2_pp2": "--pipeline-model-parallel-size 2 --use-torch-fsdp2",
        "fsdp2_pp2_no_reshard": "--pipeline-model-parallel-size 2 --use-torch-fsdp2 "
                                "--torch-fsdp2-no-reshard-after-forward",
        # Shards and gradient shards at rest in host memory (torch's CPUOffloadPolicy), the optimizer on the host.
        "fsdp2_pp2_cpu_offload": "--pipeline-model-parallel-size 2 --use-torch-fsdp2 --torch-fsdp2-cpu-offload",
        # Gradients summed (not averaged) over data parallelism, then divided by the global token count.
        "ddp_tp2_per_token": "--tensor-model-parallel-size 2 --calculate-per-token-loss",
        "fsdp2_tp2_per_token": "--tensor-model-parallel-size 2 --calculate-per-token-loss --use-torch-fsdp2",
        # bf16 parameters (fp32 main copies in the optimizer), gradients reduced in bf16 by both wrappers.
        "ddp_tp2_bf16": "--tensor-model-parallel-size 2 --bf16",
        "fsdp2_tp2_bf16": "--tensor-model-parallel-size 2 --bf16 --use-torch-fsdp2",
    }
    metrics = run_on_ranks(world_size, _pretrain_metrics, str(tmp_path), runs)[0]
    assert len(metrics["ddp_tp2"]["lm loss"]) == 4 and metrics["ddp_tp2"]["lm loss"][0] > 4.0
    # Same model, data and steps; only the order of floating-point sums may differ (~1e-7 per step). The grad
    # norm and zero count are taken over FSDP2's DTensor gradient shards; zero counts may differ by accidental
    # exact zeros (a few), while the structural ones (embedding rows of tokens not in the batch) are ~1500.
    pairs = (("fsdp2_tp2_sp", "ddp_tp2"), ("fsdp2_pp2", "ddp_pp2"), ("fsdp2_pp2_no_reshard", "ddp_pp2"),
             ("fsdp2_pp2_cpu_offload", "ddp_pp2"),
             ("fsdp2_tp2_per_token", "ddp_tp2_per_token"))
    for name, reference in pairs:
        for metric in ("lm loss", "grad norm"):
            torch.testing.assert_close(metrics[name][metric], metrics[reference][metric], rtol=1e-5, atol=0,
                                       msg=lambda m: f"{name} vs {reference}, {metric}: {m}")
        assert min(metrics[name]["num-zeros"]) > 1000
        torch.testing.assert_close(metrics[name]["num-zeros"], metrics[reference]["num-zeros"], rtol=0, atol=4)
    # bf16 sums in another order round differently (measured: loss 3e-6, grad norm 1e-4 apart after 4 steps);
    # zero counts differ more because bf16 gradients underflow to exact zeros.
    bf16, bf16_reference = metrics["fsdp2_tp2_bf16"], metrics["ddp_tp2_bf16"]
    torch.testing.assert_close(bf16["lm loss"], bf16_reference["lm loss"], rtol=1e-4, atol=0)
    torch.testing.assert_close(bf16["grad norm"], bf16_reference["grad norm"], rtol=1e-3, atol=0)
    # Offload changes where shards rest, not the arithmetic: the same numbers as FSDP2 without it.
    for metric in ("lm loss", "grad norm"):
        torch.testing.assert_close(metrics["fsdp2_pp2_cpu_offload"][metric], metrics["fsdp2_pp2"][metric],
                                   rtol=1e-6, atol=0)


# ---- parameter offload (--torch-fsdp2-cpu-offload) ----------------------------------------------------------
@pytest.mark.parametrize("device_type, can_pin, pinned", [("cuda", True, True), ("cuda", False, False),
                                                          ("cpu", True, False)])
def test_cpu_offload_policy_pins_where_the_device_can_use_it(device_type, can_pin, pinned):
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    from megatron.core.offloading.fsdp2 import fsdp2_offload_policy

    policy = fsdp2_offload_policy(True, device_type, can_pin=can_pin)
    assert isinstance(policy, CPUOffloadPolicy) and policy.pin_memory == pinned
    assert type(fsdp2_offload_policy(False, device_type, can_pin=can_pin)) is OffloadPolicy


def test_cpu_offload_needs_fsdp2():
    from megatron.core.distributed import DistributedDataParallelConfig
    from tests.unit_tests.training.test_arguments import validated

    with pytest.raises(ValueError, match=r"\(--torch-fsdp2-cpu-offload\) offloads FSDP2's shards: it needs "
                                         r"use_torch_fsdp2=True \(--use-torch-fsdp2\)"):
        DistributedDataParallelConfig(torch_fsdp2_cpu_offload=True)
    with pytest.raises(ValueError, match="--torch-fsdp2-cpu-offload offloads FSDP2's shards: it needs --use-torch-fsdp2"):
        validated("--torch-fsdp2-cpu-offload")


def _fsdp2_losses_and_device_bytes(cpu_offload, steps=3):
    """Losses of a few AdamW steps of a one-rank FSDP2 GPT on CUDA, with the device bytes held between steps and
    whether the sharded parameters are pinned host tensors."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    model = _gpt(_config(hidden_size=256, num_layers=2)).cuda()
    wrapped = _wrap(model, ddp_config=DistributedDataParallelConfig(use_torch_fsdp2=True,
                                                                    torch_fsdp2_cpu_offload=cpu_offload))
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-3), [wrapped])
    losses = []
    for step in range(steps):
        wrapped.zero_grad_buffer()
        tokens, positions, labels = (tensor.cuda() for tensor in _microbatch(step))
        loss = model(tokens, positions, labels=labels).mean()
        loss.backward()
        wrapped.finish_grad_sync()
        optimizer.step()
        losses.append(loss.item())
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - start
    local = [param.to_local() for param in model.parameters()]
    pinned_host = all(tensor.device.type == "cpu" and tensor.is_pinned() for tensor in local)
    param_bytes = sum(tensor.numel() * tensor.element_size() for tensor in local)
    return losses, held, pinned_host, param_bytes


@pytest.mark.gpu
def test_cpu_offload_keeps_parameters_gradients_and_optimizer_state_off_the_device(tmp_path):
    from megatron.core import parallel_state, tensor_parallel

    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel()
        tensor_parallel.model_parallel_cuda_manual_seed(1234)  # attention forks the model-parallel stream
        losses, held, pinned_host, param_bytes = _fsdp2_losses_and_device_bytes(False)
        offloaded_losses, offloaded_held, offloaded_pinned_host, _ = _fsdp2_losses_and_device_bytes(True)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    assert offloaded_losses == pytest.approx(losses, rel=1e-5, abs=0)  # same math; GPU kernels may reorder sums
    assert offloaded_pinned_host and not pinned_host
    # Without offload the device holds parameters, gradients and two Adam moments (16 bytes per element).
    assert held >= 4 * param_bytes > offloaded_held
