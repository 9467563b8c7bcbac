"""Rank layouts against Megatron-Core's formula: a group along some axes fixes the other axes' coordinates.

The reference below restates that formula independently: with the axes in `order` (fastest first) and prefix
products as strides, group g (its index decomposed over the fixed axes, first fastest) holds, for each index i
decomposed over the varying axes (first fastest), the rank sum(coordinate x stride).
"""

import itertools

import pytest

from megatron.core import parallel_state as ps
from megatron.core.rank_layout import RankGenerator, generate_rank_groups


def _decompose(index, sizes):
    coordinates = []
    for size in sizes:
        coordinates.append(index % size)
        index //= size
    return coordinates


def _reference_groups(sizes_in_order, varying_mask):
    strides = [1]
    for size in sizes_in_order[:-1]:
        strides.append(strides[-1] * size)
    varying = [(s, d) for s, d, m in zip(sizes_in_order, strides, varying_mask) if m]
    fixed = [(s, d) for s, d, m in zip(sizes_in_order, strides, varying_mask) if not m]
    group_size = 1
    for size, _ in varying:
        group_size *= size
    world = group_size
    for size, _ in fixed:
        world *= size
    groups = []
    for group_index in range(world // group_size):
        base = sum(c * d for c, (_, d) in zip(_decompose(group_index, [s for s, _ in fixed]), fixed))
        groups.append([base + sum(c * d for c, (_, d) in zip(_decompose(i, [s for s, _ in varying]), varying))
                       for i in range(group_size)])
    return groups


def _reference(tp, ep, dp, pp, cp, order, token):
    sizes = {"tp": tp, "ep": ep, "dp": dp, "pp": pp, "cp": cp}
    names = order.split("-") + [name for name in sizes if name not in order.split("-")]
    return _reference_groups([sizes[name] for name in names], [name in token.split("-") for name in names])


TOKENS = ["tp", "pp", "dp", "cp", "ep", "dp-cp", "tp-cp", "tp-dp", "tp-dp-cp", "tp-pp", "tp-ep", "tp-ep-pp"]


@pytest.mark.parametrize("order", ["tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp", "tp-pp-dp"])
def test_rank_generator_matches_megatron_cores_formula(order):
    for tp, ep, dp, pp, cp in [(2, 1, 2, 2, 2), (1, 1, 4, 2, 1), (4, 1, 1, 1, 2), (2, 2, 2, 1, 1), (1, 3, 2, 2, 1)]:
        if order == "tp-pp-dp" and (cp > 1 or ep > 1):
            continue
        generator = RankGenerator(tp=tp, ep=ep, dp=dp, pp=pp, cp=cp, order=order)
        assert generator.world_size == tp * ep * dp * pp * cp
        for token in TOKENS:
            assert generator.get_ranks(token) == _reference(tp, ep, dp, pp, cp, order, token), (token, tp, dp, pp)
    generator = RankGenerator(tp=2, ep=1, dp=2, pp=1, cp=1, order="tp-cp-ep-dp-pp", rank_offset=4)
    assert generator.get_ranks("dp") == [[4, 6], [5, 7]]
    assert generator.get_mask("tp-cp-ep-dp-pp", "tp-dp") == [True, False, False, True, False]
    assert ps.RankGenerator is RankGenerator
    with pytest.raises(ValueError, match=r"order 'tp-dp' must name every axis of size > 1; missing \['pp'\]"):
        RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=1, order="tp-dp")


def test_initialize_model_parallel_layouts_match_megatron_cores_generators():
    # Dense groups from a generator with ep=1; expert groups from one with tp=ETP, cp=1, dp=expert dp.
    dense_names = {"tp": "tp", "pp": "pp", "cp": "cp", "dp": "dp", "dp-cp": "dp-cp", "tp-cp": "tp-cp",
                   "tp-dp": "tp-dp", "tp-dp-cp": "tp-dp-cp", "mp": "tp-pp"}
    expert_names = {"ep": "ep", "etp": "tp", "expt-dp": "dp", "tp-ep": "tp-ep", "tp-ep-pp": "tp-ep-pp"}
    layouts = 0
    for world, tp, pp, cp, ep, etp in itertools.product([8, 16], [1, 2, 4], [1, 2], [1, 2], [1, 2, 4], [1, 2, 4]):
        if world % (tp * pp * cp) or (world // pp) % (etp * ep):
            continue
        dp = world // (tp * pp * cp)
        groups = generate_rank_groups(world, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp)
        for name, token in dense_names.items():
            assert groups[name] == _reference(tp, 1, dp, pp, cp, "tp-cp-ep-dp-pp", token), (name, world, tp, pp, cp)
        expert_dp = world // (etp * ep * pp)
        for name, token in expert_names.items():
            assert groups[name] == _reference(etp, ep, expert_dp, pp, 1, "tp-cp-ep-dp-pp", token), (
                name, world, tp, pp, cp, ep, etp)
        layouts += 1
    assert layouts > 60
