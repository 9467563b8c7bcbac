"""The interleaved 1F1B plan without processes: the order of forwards and backwards per rank against hand-written
orders, and a simulation of all ranks' exchanges that checks every transfer reaches the right stage."""

import collections

import pytest

from megatron.core.pipeline_parallel.interleaved_plan import (
    InterleavedPlan,
    check_microbatches,
    num_warmup_forwards,
    schedule_table,
)

# F<microbatch><chunk> / B<microbatch><chunk>; "|" separates warm-up, each steady 1F1B pair and cool-down.
EXPECTED_ORDERS = {
    # p = v = 2, M = 4 (the example of upstream's semantics).
    (2, 2, 4): [
        "F00 F10 F01 F11 | F20 B01 | F30 B11 | F21 B00 | F31 B10 | B21 B31 B20 B30",
        "F00 F10 | F01 B01 | F11 B11 | F20 B00 | F30 B10 | F21 B21 | F31 B31 | B20 B30",
    ],
    # p = v = 2, M = 8: four groups of two microbatches.
    (2, 2, 8): [
        "F00 F10 F01 F11 | F20 B01 | F30 B11 | F21 B00 | F31 B10 | F40 B21 | F50 B31 | F41 B20 | F51 B30 | "
        "F60 B41 | F70 B51 | F61 B40 | F71 B50 | B61 B71 B60 B70",
        "F00 F10 | F01 B01 | F11 B11 | F20 B00 | F30 B10 | F21 B21 | F31 B31 | F40 B20 | F50 B30 | F41 B41 | "
        "F51 B51 | F60 B40 | F70 B50 | F61 B61 | F71 B71 | B60 B70",
    ],
}


@pytest.mark.parametrize("pipeline_size, num_chunks, num_microbatches", sorted(EXPECTED_ORDERS))
def test_order_of_forwards_and_backwards_matches_the_hand_written_one(pipeline_size, num_chunks, num_microbatches):
    for rank, expected in enumerate(EXPECTED_ORDERS[(pipeline_size, num_chunks, num_microbatches)]):
        plan = InterleavedPlan(pipeline_size, rank, num_chunks, num_microbatches)
        assert plan.compute_order() == expected.replace("| ", "").split(), rank


def test_schedule_table_and_warmup():
    assert schedule_table(5, 2, 3) == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1), (3, 0), (4, 0), (3, 1), (4, 1)]
    assert num_warmup_forwards(4, 0, 2, 4, 16) == 2 * 3 + 4
    assert num_warmup_forwards(4, 3, 2, 4, 16) == 4
    assert num_warmup_forwards(4, 0, 3, 4, 12) == 12  # capped at every forward


@pytest.mark.parametrize(
    "num_microbatches, group_size, message",
    [(3, 2, "must be 0 or at least --pipeline-model-parallel-size"),
     (4, 1, "between --pipeline-model-parallel-size"),
     (4, 5, "between --pipeline-model-parallel-size")],
)
def test_microbatch_count_rule_names_the_flags(num_microbatches, group_size, message):
    with pytest.raises(ValueError, match=message) as error:
        check_microbatches(num_microbatches, 2, group_size)
    assert "--microbatch-group-size-per-virtual-pipeline-stage" in str(error.value)


def test_microbatch_count_rule_accepts_a_long_enough_last_group():
    check_microbatches(7, 2, 4)  # groups of 4 and 3
    check_microbatches(8, 2, 2)
    check_microbatches(6, 2)  # the default group size: 6 is a multiple of the pipeline size
    assert InterleavedPlan(2, 0, 2, 6).group_size == 2


@pytest.mark.parametrize(
    "num_microbatches, message",
    [(3, r"with the default --microbatch-group-size-per-virtual-pipeline-stage \(the pipeline size\) needs the "
         r"number of microbatches per global batch \(3 = .*\) to be a multiple of --pipeline-model-parallel-size "
         r"\(2\): change --global-batch-size, or set --microbatch-group-size-per-virtual-pipeline-stage N with "
         r"2 <= N <= 3"),
     (1, r"needs the number of microbatches per global batch \(1 = .*\) to be at least "
         r"--pipeline-model-parallel-size \(2\): raise --global-batch-size")],
)
def test_microbatch_count_rule_says_when_the_group_size_is_the_default(num_microbatches, message):
    with pytest.raises(ValueError, match=message):
        check_microbatches(num_microbatches, 2)
    with pytest.raises(ValueError, match=message):
        InterleavedPlan(2, 0, 2, num_microbatches)


def test_microbatch_count_rule_with_a_given_group_size_does_not_mention_the_default():
    with pytest.raises(ValueError) as error:
        check_microbatches(5, 2, 4)
    assert "modulo --microbatch-group-size-per-virtual-pipeline-stage (4) must be 0 or at least " \
           "--pipeline-model-parallel-size (2), got 1" in str(error.value)
    assert "default" not in str(error.value)


def _simulate(pipeline_size, num_chunks, num_microbatches, group_size=None, forward_only=False, eager_sends=False):
    """Run every rank's plan against the others and check each received tensor is the one its chunk's next step
    needs. Strict (`eager_sends=False`): a send completes only when received, and sends and receives between two
    ranks match in posting order whatever their kind (NCCL's matching); an exchange waits for all its operations.
    Eager: an exchange waits for its receives only, and transfers match per kind (gloo with one tag per kind, the
    sends completed later)."""
    plans = [InterleavedPlan(pipeline_size, rank, num_chunks, num_microbatches, group_size, forward_only)
             for rank in range(pipeline_size)]
    last_stage = pipeline_size * num_chunks - 1
    inputs = [collections.defaultdict(collections.deque) for _ in plans]
    grads = [collections.defaultdict(collections.deque) for _ in plans]
    awaiting = [collections.defaultdict(collections.deque) for _ in plans]
    sends, recvs = collections.defaultdict(collections.deque), collections.defaultdict(collections.deque)
    position, pending = [0] * pipeline_size, [0] * pipeline_size

    def compute_and_post(rank):
        plan, step = plans[rank], plans[rank].steps[position[rank]]
        nxt, prev = (rank + 1) % pipeline_size, (rank - 1) % pipeline_size
        produced_activation = produced_grad = None
        if step.forward is not None:
            microbatch, chunk = plan.forward_of(step.forward)
            stage = chunk * pipeline_size + rank
            received = inputs[rank][chunk].popleft() if stage > 0 else None
            assert received == (None if stage == 0 else ("activation", microbatch, stage - 1)), (rank, step)
            awaiting[rank][chunk].append(microbatch)
            produced_activation = ("activation", microbatch, stage)
        if step.backward is not None:
            microbatch, chunk = plan.backward_of(step.backward)
            stage = chunk * pipeline_size + rank
            assert awaiting[rank][chunk].popleft() == microbatch, (rank, step)  # first in, first out per chunk
            received = grads[rank][chunk].popleft() if stage < last_stage else None
            assert received == (None if stage == last_stage else ("grad", microbatch, stage + 1)), (rank, step)
            produced_grad = ("grad", microbatch, stage)
        # Posting order of the exchange: send next, receive prev, send prev, receive next.
        operations = []
        if step.send_forward:
            assert produced_activation is not None
            operations.append(("send", nxt, "activation", produced_activation))
        if step.recv_forward_chunk is not None:
            operations.append(("recv", prev, "activation", (inputs[rank], step.recv_forward_chunk)))
        if step.send_backward:
            assert produced_grad is not None
            operations.append(("send", prev, "grad", produced_grad))
        if step.recv_backward_chunk is not None:
            operations.append(("recv", nxt, "grad", (grads[rank], step.recv_backward_chunk)))
        for kind, peer, what, value in operations:
            if kind == "send":
                sends[(rank, peer) + ((what,) if eager_sends else ())].append((what, value, rank))
            else:
                recvs[(peer, rank) + ((what,) if eager_sends else ())].append((what, value, rank))
        pending[rank] = sum(1 for operation in operations if operation[0] == "recv" or not eager_sends)

    rounds = 0
    while any(position[rank] < len(plans[rank].steps) for rank in range(pipeline_size)):
        rounds += 1
        for rank in range(pipeline_size):
            if position[rank] < len(plans[rank].steps) and pending[rank] == 0 and not _posted(rank, recvs) and (
                    eager_sends or not _posted(rank, sends)):
                compute_and_post(rank)
        progressed = False
        for channel in list(sends):
            while sends[channel] and recvs[channel]:
                sent_kind, payload, sender = sends[channel].popleft()
                recv_kind, (queues, chunk), receiver = recvs[channel].popleft()
                assert sent_kind == recv_kind, f"{channel}: {sent_kind} matched with a receive of a {recv_kind}"
                queues[chunk].append(payload)
                if not eager_sends:
                    pending[sender] -= 1
                pending[receiver] -= 1
                progressed = True
        for rank in range(pipeline_size):
            if position[rank] < len(plans[rank].steps) and pending[rank] == 0:
                position[rank] += 1
                progressed = True
        assert progressed, f"deadlock at steps {position}"
    assert not any(sends.values()) and not any(recvs.values())
    for rank in range(pipeline_size):
        assert not any(inputs[rank].values()) and not any(grads[rank].values())
        assert not any(awaiting[rank].values()) or forward_only
    return rounds


def _posted(rank, channels):
    return any(entry[2] == rank for queue in channels.values() for entry in queue)


@pytest.mark.parametrize(
    "pipeline_size, num_chunks, num_microbatches, group_size",
    [(2, 2, 4, None), (2, 2, 8, None), (2, 2, 2, None), (2, 3, 6, None), (4, 2, 8, None), (4, 2, 4, None),
     (3, 2, 6, None), (4, 3, 12, None), (2, 2, 7, 4), (4, 2, 10, 6), (2, 4, 8, 4), (3, 3, 9, 3)],
)
def test_every_transfer_reaches_the_stage_that_needs_it(pipeline_size, num_chunks, num_microbatches, group_size):
    for forward_only in (False, True):
        _simulate(pipeline_size, num_chunks, num_microbatches, group_size, forward_only, eager_sends=True)
        if group_size in (None, pipeline_size):
            # Groups of p microbatches: each exchange pairs with exactly one exchange of each neighbour, in order.
            _simulate(pipeline_size, num_chunks, num_microbatches, group_size, forward_only)
