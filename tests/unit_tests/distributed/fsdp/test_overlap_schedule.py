"""Where collectives are issued and waited for: side streams with events, reductions in flight, outer reductions.

A CPU has no streams or events, so the stream logic is observed through a recording stand-in for the
accelerator's primitives (the compute stream, the side-stream context and events); everything else, the
collectives included, is real. What a CPU cannot show is the overlap itself (kernels running beside each
other); the GPU-marked tests in test_gpu.py measure the outcome there."""

import sys

import pytest
import torch

from tests.unit_tests.distributed.fsdp import fsdp_test_models as models
from tests.unit_tests.multiprocess_harness import run_on_ranks

NUM_STEPS = 2
COLLECTIVES = {"all_gather_flat": "all_gather", "all_gather_pieces_in_place": "all_gather",
               "reduce_scatter_flat": "reduce_scatter", "reduce_scatter_coalesced": "reduce_scatter",
               "all_reduce": "reduce_scatter"}


def _called_from(function_name):
    """Whether a function of that name is on the caller's stack (a cheap frame walk, no source lookups)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == function_name:
            return True
        frame = frame.f_back
    return False


class _FakeStream:
    def __init__(self, name, recorder):
        self.name, self.recorder = name, recorder

    def record_event(self):
        event = (self.name, len(self.recorder.recorded))
        self.recorder.recorded.append(event)
        return event

    def wait_event(self, event):  # only the compute stream waits on events
        in_grad_hook = _called_from("on_grad_accumulated")
        self.recorder.waited.append((event, in_grad_hook))


def _recording_streams():
    """A CommunicationStreams whose accelerator primitives record what the schedule does with them."""
    import contextlib

    from megatron_fsdp.streams import CommunicationStreams

    class RecordingStreams(CommunicationStreams):
        def __init__(self):
            super().__init__(torch.device("cpu"))
            self.enabled = True
            self.recorded, self.waited, self.issued = [], [], []
            self.current = "compute"
            self.compute = _FakeStream("compute", self)
            self.all_gather = _FakeStream("all_gather", self)
            self.reduce_scatter = _FakeStream("reduce_scatter", self)

        def compute_stream(self):
            return self.compute

        @contextlib.contextmanager
        def _on(self, stream):
            previous, self.current = self.current, stream.name
            try:
                yield
            finally:
                self.current = previous

    return RecordingStreams()


def _record_collectives(streams, outer_group=None):
    """Wrap the schedule's collectives: log (name, stream current at issue, outer group?, inside backward?)."""
    from megatron_fsdp import collectives
    from megatron_fsdp.utils import in_backward_pass

    originals = {name: getattr(collectives, name) for name in COLLECTIVES}

    def wrap(name):
        def issue(*args, **kwargs):
            group = args[2] if name != "all_reduce" else args[1]
            streams.issued.append((name, streams.current, group is outer_group and outer_group is not None,
                                   in_backward_pass()))
            return originals[name](*args, **kwargs)
        return issue

    for name in COLLECTIVES:
        setattr(collectives, name, wrap(name))
    return lambda: [setattr(collectives, name, fn) for name, fn in originals.items()]


def _in_flight_bound(model):
    schedule, observed = model.schedule, []
    launch = schedule.launch_reduce

    def bounded_launch(group, async_op):
        launch(group, async_op)
        # collectives in flight (small reductions held and issued together share one)
        observed.append(len({id(entry[0]) for entry in schedule.pending_reduces}))

    schedule.launch_reduce = bounded_launch
    return observed


def _streams_and_bounds():
    import megatron_fsdp

    results = {}
    for strategy in (0, 1, 3):  # all-reduce; reduce-scatter into a persistent buffer; gather and transient grads
        model = models.make_model(0)
        optimizer = models.make_optimizer([p for p in model.parameters() if p.requires_grad])
        model, optimizer = megatron_fsdp.fully_shard(model, optimizer, fsdp_unit_modules=[models.Block],
                                                     zero_dp_strategy=strategy)
        streams = _recording_streams()
        model.schedule.streams = streams
        in_flight = _in_flight_bound(model)
        restore = _record_collectives(streams)
        try:
            # microbatches without no_sync: strategies 0/1 reduce persistent buffers twice per step
            losses = models.train_sharded(model, optimizer, NUM_STEPS, microbatches=2)
        finally:
            restore()
        results[strategy] = dict(
            losses=losses, issued=[(name, stream) for name, stream, _, _ in streams.issued],
            recorded=list(streams.recorded), waited=[event for event, _ in streams.waited],
            waited_in_grad_hook=[event for event, in_hook in streams.waited if in_hook],
            max_in_flight=max(in_flight), bound=model.schedule.max_reduces_in_flight)
    return results


@pytest.mark.parametrize("world_size", [2])
def test_collectives_run_on_side_streams_and_compute_waits_on_events(world_size):
    reference, _ = models.reference_losses(NUM_STEPS)
    for per_rank in run_on_ranks(world_size, _streams_and_bounds):
        for strategy, result in per_rank.items():
            assert result["losses"] == pytest.approx(reference, abs=1e-5), strategy
            issued = result["issued"]
            names = {name for name, _ in issued}
            if strategy == 0:
                assert names == {"all_reduce"}, (strategy, issued)
            else:
                # gloo's all-gathers land each parameter's chunk in place (a one-parameter group's shard is already
                # in its unsharded form and is gathered flat); test_stock_collectives covers the stock path
                # (this model's small reductions go out together: reduce_scatter_coalesced under strategy 3)
                assert "all_gather_pieces_in_place" in names and names & {"reduce_scatter_flat",
                                                                           "reduce_scatter_coalesced"}
                assert names <= {"all_gather_flat", "all_gather_pieces_in_place", "reduce_scatter_flat",
                                 "reduce_scatter_coalesced"}, (strategy, issued)
            # every gather on the all-gather stream, every gradient reduction on the reduce-scatter stream
            for name, stream in issued:
                assert stream == COLLECTIVES[name], (strategy, name, stream)
            # each collective's event is waited for once by the compute stream, never inside a gradient hook
            assert sorted(result["waited"]) == sorted(result["recorded"]), strategy
            assert len(result["recorded"]) == len(issued)
            assert result["waited_in_grad_hook"] == [], strategy
            assert result["max_in_flight"] <= result["bound"] == 1, strategy


def _outer_reductions_during_backward():
    from tests.unit_tests.distributed.fsdp.test_hfsdp import _mesh_kwargs

    import megatron_fsdp

    results = {}
    cases = [(f"hsdp_s{strategy}", strategy, "no_shard", average, use_no_sync)
             for strategy in (0, 1, 2, 3) for average in (False, True) for use_no_sync in (True, False)]
    cases += [("hfsdp", 3, "optim", False, True), ("hfsdp", 3, "optim", False, False)]
    for name, strategy, outer, average, use_no_sync in cases:
        mesh_kwargs = dict(_mesh_kwargs(), outer_dp_sharding_strategy=outer)
        model = models.make_model(0)
        optimizer = models.make_optimizer([p for p in model.parameters() if p.requires_grad])
        model, optimizer = megatron_fsdp.fully_shard(model, optimizer, fsdp_unit_modules=[models.Block],
                                                     zero_dp_strategy=strategy, average_in_collective=average,
                                                     **mesh_kwargs)
        if not use_no_sync:  # every microbatch synced: each one's outer reduction adds to the previous one's
            model.no_sync = models._null
        streams = _recording_streams()
        model.schedule.streams = streams
        restore = _record_collectives(streams, model.topology.outer_group)
        try:
            # 3 samples per rank: 3 microbatches, no_sync on all but the last (or on none)
            losses = models.train_sharded(model, optimizer, NUM_STEPS, microbatches=3)
        finally:
            restore()
        # (HFSDP also all-gathers main-weight sub-shards over the outer group after each step: not a reduction)
        outer_reductions = [(stream, in_backward) for name, stream, on_outer, in_backward in streams.issued
                            if on_outer and COLLECTIVES[name] != "all_gather"]
        trainable_groups = sum(1 for group in model.groups if group.trainable)
        synced_microbatches = 1 if use_no_sync else 3
        results[(name, average, use_no_sync)] = (losses, outer_reductions, trainable_groups * synced_microbatches)
    return results


@pytest.mark.parametrize("world_size", [4])
def test_outer_reductions_overlap_the_backward(world_size):
    reference, _ = models.reference_losses(NUM_STEPS)
    for per_rank in run_on_ranks(world_size, _outer_reductions_during_backward):
        for name, (losses, outer_reductions, reductions_per_step) in per_rank.items():
            assert losses == pytest.approx(reference, abs=1e-5), name
            # every strategy: one outer reduction per trainable group and synced microbatch (none for the no_sync
            # ones), every one issued on the reduce-scatter stream while the backward is still running
            assert len(outer_reductions) == reductions_per_step * NUM_STEPS, (name, outer_reductions)
            assert all(stream == "reduce_scatter" and in_backward for stream, in_backward in outer_reductions), (
                name, outer_reductions)
