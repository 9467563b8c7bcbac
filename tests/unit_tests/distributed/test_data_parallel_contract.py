"""The data-parallel wrapper contract: every wrapper implements `DataParallelWrapper`, the config picks the
wrapper in one place, each config rule is stated once (in `DistributedDataParallelConfig`) with the flag names,
and the command line refuses the same combinations, naming the same flags."""

import inspect
import pathlib

import pytest
import torch

import megatron.core.distributed as distributed
from megatron.core.distributed import (
    DataParallelWrapper,
    DistributedDataParallel,
    DistributedDataParallelConfig,
    MegatronFSDPAdapter,
    TorchFSDP2,
    data_parallel_wrapper_class,
    unwrap_model,
    wrap_data_parallel,
)
from megatron.core.distributed.data_parallel_base import parameter_and_grad_bytes
from tests.unit_tests.multiprocess_harness import run_on_ranks
from tests.unit_tests.optimizer.toy_models import build_toy_model, toy_batch

WRAPPERS = (DistributedDataParallel, MegatronFSDPAdapter, TorchFSDP2)
CONTRACT_METHODS = ("no_sync", "start_grad_sync", "finish_grad_sync", "scale_gradients", "zero_grad_buffer",
                    "start_param_sync", "finish_param_sync", "broadcast_params", "state_bytes")
DISTRIBUTED_SOURCE = pathlib.Path(distributed.__file__).parent


@pytest.mark.parametrize("wrapper", WRAPPERS, ids=lambda cls: cls.__name__)
def test_every_wrapper_implements_the_whole_contract(wrapper):
    assert issubclass(wrapper, DataParallelWrapper) and not inspect.isabstract(wrapper)
    assert sorted(DataParallelWrapper.__abstractmethods__) == sorted(CONTRACT_METHODS)
    for name in CONTRACT_METHODS:
        implementation = getattr(wrapper, name)
        assert implementation is not getattr(DataParallelWrapper, name), f"{wrapper.__name__}.{name}"
    # One fallback to the wrapped model, in the base only.
    assert "__getattr__" not in vars(wrapper)


def test_upstream_names_and_import_paths_still_work():
    from megatron.core.distributed import FullyShardedDataParallel, TorchFullyShardedDataParallel
    from megatron.core.distributed.fsdp import FullyShardedDataParallel as FromFsdpPackage
    from megatron.core.distributed.fsdp import default_fsdp_unit_modules
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel as FromAdapter
    from megatron.core.distributed.torch_fully_sharded_data_parallel import (
        TorchFullyShardedDataParallel as FromTorchModule,
    )
    from megatron.core.ssm.mamba_layer import MambaLayer
    from megatron.core.transformer.transformer_layer import TransformerLayer

    assert FullyShardedDataParallel is FromFsdpPackage is FromAdapter is MegatronFSDPAdapter
    assert TorchFullyShardedDataParallel is FromTorchModule is TorchFSDP2
    assert default_fsdp_unit_modules() == (TransformerLayer, MambaLayer)  # a hybrid model's layers are units too
    assert default_fsdp_unit_modules(embedding_unit=True)[:2] == (TransformerLayer, MambaLayer)


@pytest.mark.parametrize(
    "settings, expected",
    [
        ({}, DistributedDataParallel),
        ({"use_distributed_optimizer": True}, DistributedDataParallel),
        ({"use_megatron_fsdp": True}, MegatronFSDPAdapter),
        ({"use_megatron_fsdp": True, "data_parallel_sharding_strategy": "optim"}, MegatronFSDPAdapter),
        ({"use_torch_fsdp2": True}, TorchFSDP2),
    ],
)
def test_the_config_picks_the_wrapper(settings, expected):
    assert data_parallel_wrapper_class(DistributedDataParallelConfig(**settings)) is expected


# (config fields, the flags its message must name, the same combination on the command line, world size)
RULES = [
    ({"use_megatron_fsdp": True, "use_torch_fsdp2": True}, "--use-megatron-fsdp and --use-torch-fsdp2",
     "--use-megatron-fsdp --use-torch-fsdp2", 2),
    ({"use_torch_fsdp2": True, "use_distributed_optimizer": True}, "--use-torch-fsdp2 and --use-distributed-optimizer",
     "--use-torch-fsdp2 --untie-embeddings-and-output-weights --use-distributed-optimizer", 2),
    ({"fp8_param_gather": True}, "--fp8-param-gather needs --use-distributed-optimizer",
     "--fp8-format e4m3 --fp8-param-gather", 2),
    ({"fp8_param_gather": True, "use_megatron_fsdp": True, "data_parallel_sharding_strategy": "optim_grads"},
     "--fp8-param-gather with --use-megatron-fsdp needs --data-parallel-sharding-strategy optim_grads_params",
     "--use-megatron-fsdp --fp8-format e4m3 --fp8-param-gather --data-parallel-sharding-strategy optim_grads", 2),
    ({"overlap_param_gather": True, "use_distributed_optimizer": True}, "--overlap-grad-reduce",
     "--overlap-param-gather --use-distributed-optimizer", 1),
    ({"overlap_param_gather": True, "overlap_grad_reduce": True}, "--use-distributed-optimizer",
     "--overlap-param-gather --overlap-grad-reduce", 1),
    ({"fsdp_double_buffer": True}, "--fsdp-double-buffer", "--fsdp-double-buffer", 1),
]


@pytest.mark.parametrize("fields, flags, command_line, world_size", RULES, ids=[str(rule[0]) for rule in RULES])
def test_each_rule_is_refused_by_the_config_and_the_command_line_naming_the_flags(monkeypatch, fields, flags,
                                                                                  command_line, world_size):
    from tests.unit_tests.training.test_arguments import validated

    with pytest.raises(ValueError, match=flags.split(" ")[0]) as from_config:
        DistributedDataParallelConfig(**fields)
    assert flags in str(from_config.value)
    with pytest.raises(ValueError) as from_command_line:
        validated(command_line, world_size, monkeypatch)
    named = [word for word in flags.split(" ") if word.startswith("--")]
    assert all(flag in str(from_command_line.value) for flag in named), str(from_command_line.value)


def test_the_zero3_fp8_rule_is_written_once_among_the_wrappers_and_the_config():
    """The wrappers rely on the config: the rule's message appears in the config module only."""
    message = "only ZeRO-3 all-gathers the compute weights"
    holders = [path.relative_to(DISTRIBUTED_SOURCE).as_posix() for path in DISTRIBUTED_SOURCE.rglob("*.py")
               if "megatron_fsdp" not in path.parts and message in path.read_text()]
    assert holders == ["distributed_data_parallel_config.py"]


def test_fsdp2_keeps_its_config_marked_and_validated():
    """TorchFSDP2 built from a plain config re-validates it as an FSDP2 config: the config's FSDP2 rules hold."""
    with pytest.raises(ValueError, match="drop --use-distributed-optimizer"):
        TorchFSDP2(None, DistributedDataParallelConfig(use_distributed_optimizer=True), torch.nn.Linear(2, 2))


class _RecordingWrapper(DataParallelWrapper):
    """A minimal wrapper: the base's forward, state dict and fallback, with the contract's methods recorded."""

    def __init__(self, module, ddp_config=None):
        super().__init__(config=None, ddp_config=ddp_config or DistributedDataParallelConfig())
        self.module = module
        self.data_parallel_group = None

    def no_sync(self):
        raise NotImplementedError

    start_grad_sync = finish_grad_sync = zero_grad_buffer = finish_param_sync = broadcast_params = (
        lambda self: None)

    def scale_gradients(self, scaling_factor):
        pass

    def start_param_sync(self, force_sync=False):
        pass

    def state_bytes(self):
        return parameter_and_grad_bytes(self.module)


def test_base_forwards_unwraps_and_falls_back_to_the_wrapped_model():
    model = build_toy_model()
    model.marker = "from the model"
    wrapped = _RecordingWrapper(_RecordingWrapper(model))
    inputs, _ = toy_batch(0, 4)
    torch.testing.assert_close(wrapped(inputs), model(inputs))
    assert unwrap_model(wrapped) is model and unwrap_model([wrapped, model]) == [model, model]
    assert wrapped.marker == "from the model"
    assert list(wrapped.state_dict()) == list(model.state_dict())
    with pytest.raises(AttributeError):
        wrapped.not_an_attribute_anywhere
    assert wrapped.state_bytes() == {"params_bytes": 4 * sum(p.numel() for p in model.parameters()),
                                     "grads_bytes": 0}


def _wrap_each_kind_and_use_the_contract():
    """Every wrapper the factory builds: an instance of the base, unwrapped to the model, the state-dict face
    with the model's names, and one step of the gradient contract reducing to the full-batch gradient norm."""
    rank = torch.distributed.get_rank()
    world_size = torch.distributed.get_world_size()
    inputs, targets = toy_batch(0, 4 * world_size)
    reference = build_toy_model()
    torch.nn.functional.mse_loss(reference(inputs), targets).backward()
    expected_norm = torch.cat([param.grad.reshape(-1) for param in reference.parameters()]).norm().item()
    names = list(reference.state_dict())
    results = {}
    for settings in ({}, {"use_distributed_optimizer": True}, {"use_megatron_fsdp": True},
                     {"use_torch_fsdp2": True}):
        model = build_toy_model()
        config = type("ModelConfig", (), {"params_dtype": torch.float32})()
        wrapped = wrap_data_parallel(config, DistributedDataParallelConfig(**settings), model)
        assert isinstance(wrapped, DataParallelWrapper) and unwrap_model(wrapped) is model
        assert sorted(wrapped.state_dict()) == sorted(names)
        wrapped.zero_grad_buffer()
        local = slice(4 * rank, 4 * rank + 4)
        half = slice(4 * rank, 4 * rank + 2), slice(4 * rank + 2, 4 * rank + 4)
        with wrapped.no_sync():
            torch.nn.functional.mse_loss(wrapped(inputs[half[0]]), targets[half[0]]).mul(0.5).backward()
        torch.nn.functional.mse_loss(wrapped(inputs[half[1]]), targets[half[1]]).mul(0.5).backward()
        wrapped.start_grad_sync(model.parameters())  # as the schedules call config.grad_sync_func
        wrapped.finish_grad_sync()
        wrapped.start_param_sync(model.parameters(), force_sync=True)  # ... and config.param_sync_func
        wrapped.finish_param_sync()
        report = wrapped.state_bytes()
        assert {"params_bytes", "grads_bytes"} <= set(report) and report["params_bytes"] > 0
        results[type(wrapped).__name__ + str(sorted(settings))] = _grad_norm(wrapped, local)
    return expected_norm, results


def _grad_norm(wrapped, _):
    from megatron.core.distributed.data_parallel_base import local_tensor

    if isinstance(wrapped, MegatronFSDPAdapter):
        pieces = [piece.grad.float().reshape(-1) for piece in wrapped.optimizer_grad_pieces()]
        total = torch.cat(pieces).square().sum() if pieces else torch.zeros(())
        for group in wrapped.grad_shard_groups():
            torch.distributed.all_reduce(total, group=group)
        return total.sqrt().item()
    squares = torch.zeros(())
    if isinstance(wrapped, DistributedDataParallel) and wrapped.ddp_config.use_distributed_optimizer:
        # Reduce-scattered: each rank holds the reduced gradient of the elements it owns.
        for buffer in wrapped.buffers:
            for param in buffer.params:
                ranges = buffer.local_shard_ranges(param)
                if ranges is not None:
                    squares += param.main_grad.reshape(-1)[ranges[0]:ranges[1]].float().square().sum()
        torch.distributed.all_reduce(squares, group=wrapped.buffers[0].groups.shard_group)
        return squares.sqrt().item()
    for param in wrapped.unwrapped_module.parameters():
        grad = getattr(param, "main_grad", None)
        grad = grad if grad is not None else param.grad
        squares += local_tensor(grad).float().square().sum()
    if isinstance(wrapped, TorchFSDP2):
        torch.distributed.all_reduce(squares)
    return squares.sqrt().item()


@pytest.mark.parametrize("world_size", [2])
def test_every_wrapper_the_factory_builds_keeps_the_contract(world_size):
    for expected_norm, results in run_on_ranks(world_size, _wrap_each_kind_and_use_the_contract):
        assert len(results) == 4
        for label, norm in results.items():
            assert norm == pytest.approx(expected_norm, rel=1e-5), label


def test_no_class_name_matching_is_left_for_wrappers():
    """Wrappers are recognised by type (the base class), never by their class names as strings."""
    root = pathlib.Path(distributed.__file__).parents[3]
    for relative in ("megatron/training/checkpointing.py", "megatron/core/dist_checkpointing/model_state.py",
                     "megatron/core/dist_checkpointing/fsdp_state.py", "megatron/core/dist_checkpointing/wrappers.py",
                     "megatron/core/dist_checkpointing/optimizer_state.py"):
        text = (root / relative).read_text()
        assert "WRAPPER_CLASS_NAMES" not in text and "CLASS_NAMES" not in text, relative
        assert "type(optimizer).__name__ ==" not in text and "type(chunk).__name__ in" not in text, relative


def test_upstream_fsdp_fields_have_their_effect():
    """`preserve_fp32_weights=False` keeps the parameters' dtype for Megatron-FSDP's main weights (an explicit
    lower-precision choice stays), and `keep_fp8_transpose_cache=True` turns the kept FP8 weight transpose on in the
    wrapped model's FP8-capable linear layers (and only with it)."""
    assert DistributedDataParallelConfig().megatron_fsdp_main_params_dtype == torch.float32
    assert DistributedDataParallelConfig(preserve_fp32_weights=False).megatron_fsdp_main_params_dtype is None
    kept_bf16 = DistributedDataParallelConfig(preserve_fp32_weights=False,
                                              megatron_fsdp_main_params_dtype=torch.bfloat16)
    assert kept_bf16.megatron_fsdp_main_params_dtype == torch.bfloat16

    class Fp8CapableLinear(torch.nn.Linear):
        def __init__(self):
            super().__init__(4, 4)
            self._fp8_keep_transpose = False

    for keep in (False, True):
        model = torch.nn.Sequential(Fp8CapableLinear(), torch.nn.ReLU(), Fp8CapableLinear())
        _RecordingWrapper(model, DistributedDataParallelConfig(keep_fp8_transpose_cache=keep))
        assert [layer._fp8_keep_transpose for layer in (model[0], model[2])] == [keep, keep]


PER_TOKEN_AND_AVERAGE = ("--calculate-per-token-loss", "--ddp-average-in-collective")


@pytest.mark.parametrize("wrapper", WRAPPERS, ids=lambda cls: cls.__name__)
def test_every_wrapper_refuses_averaging_per_token_gradients(wrapper):
    """Per-token gradients are summed over the data-parallel ranks and divided by the global token count in
    finalize_model_grads: an average in the collective would divide them by DP once more (DDP trained on half the
    gradient), so every wrapper refuses the pair before building anything, naming both flags."""
    config = type("ModelConfig", (), {"params_dtype": torch.float32, "calculate_per_token_loss": True})()
    settings = {DistributedDataParallel: {}, MegatronFSDPAdapter: {"use_megatron_fsdp": True},
                TorchFSDP2: {"use_torch_fsdp2": True}}[wrapper]
    ddp_config = DistributedDataParallelConfig(average_in_collective=True, **settings)
    with pytest.raises(ValueError) as refused:
        wrapper(config, ddp_config, build_toy_model())
    assert all(flag in str(refused.value) for flag in PER_TOKEN_AND_AVERAGE), str(refused.value)


@pytest.mark.parametrize("wrapper_flags", ["", "--use-distributed-optimizer", "--use-megatron-fsdp",
                                           "--use-torch-fsdp2 --untie-embeddings-and-output-weights"])
def test_the_command_line_refuses_averaging_per_token_gradients(monkeypatch, wrapper_flags):
    from tests.unit_tests.training.test_arguments import validated

    with pytest.raises(ValueError) as refused:
        validated(f"{wrapper_flags} {' '.join(PER_TOKEN_AND_AVERAGE)}", 2, monkeypatch)
    message = str(refused.value)
    assert all(flag in message for flag in PER_TOKEN_AND_AVERAGE) and "drop" in message, message
    assert validated(PER_TOKEN_AND_AVERAGE[0], 2, monkeypatch).calculate_per_token_loss


@pytest.mark.parametrize("wrapper_flags", ["", "--use-distributed-optimizer",
                                           "--use-torch-fsdp2 --untie-embeddings-and-output-weights"])
def test_a_megatron_fsdp_strategy_spelled_at_its_default_warns_without_megatron_fsdp(monkeypatch, wrapper_flags):
    """`--data-parallel-sharding-strategy optim_grads_params` (the default value, asked for explicitly) trains
    as the other wrapper does, like any other strategy value: the warning says so; leaving it out warns nothing."""
    import warnings

    from tests.unit_tests.training.test_arguments import validated

    flag = "--data-parallel-sharding-strategy optim_grads_params"
    with pytest.warns(UserWarning, match=f"^{flag} has no effect without --use-megatron-fsdp"):
        validated(f"{wrapper_flags} {flag}", 2, monkeypatch)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="--data-parallel-sharding-strategy")
        assert validated(wrapper_flags, 2, monkeypatch).data_parallel_sharding_strategy == "optim_grads_params"
        assert validated(f"--use-megatron-fsdp {flag}", 2, monkeypatch).use_megatron_fsdp


FSDP2 = "--use-torch-fsdp2 --untie-embeddings-and-output-weights"


@pytest.mark.parametrize("flags, reshard_after_forward", [
    ("--torch-fsdp2-no-reshard-after-forward", False),
    ("--no-torch-fsdp2-reshard-after-forward", False),
    ("--torch-fsdp2-reshard-after-forward", True),
    ("--torch-fsdp2-no-reshard-after-forward --torch-fsdp2-reshard-after-forward", True),
])
def test_fsdp2_reshard_after_forward_spellings(monkeypatch, flags, reshard_after_forward):
    from tests.unit_tests.training.test_arguments import validated

    assert validated(f"{FSDP2} {flags}", 2, monkeypatch).torch_fsdp2_reshard_after_forward is reshard_after_forward


@pytest.mark.parametrize("flags, named", [
    ("--torch-fsdp2-no-reshard-after-forward", "--torch-fsdp2-no-reshard-after-forward"),
    (f"{FSDP2} --ddp-bucket-size 1000", "--ddp-bucket-size"),
    (f"{FSDP2} --ddp-average-in-collective", "--ddp-average-in-collective"),
])
def test_settings_the_chosen_wrapper_does_not_read_warn(monkeypatch, flags, named):
    """FSDP2's resharding switch changes nothing under DDP, and FSDP2 has no gradient buckets and picks its own
    reduction: each such flag warns instead of being dropped without a word."""
    from tests.unit_tests.training.test_arguments import validated

    with pytest.warns(UserWarning, match=f"^{named} has no effect"):
        validated(flags, 2, monkeypatch)
