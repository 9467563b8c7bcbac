"""Upstream's helpers that walk nested state dicts (dicts and lists; everything else is a leaf)."""

from typing import Callable, Iterator


def dict_list_map_inplace(fn: Callable, tree):
    """Replace, in place, every leaf of the dicts and lists of `tree` with `fn(leaf)`; returns `tree` (or
    `fn(tree)` for a leaf)."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            tree[key] = dict_list_map_inplace(fn, value)
        return tree
    if isinstance(tree, list):
        tree[:] = [dict_list_map_inplace(fn, value) for value in tree]
        return tree
    return fn(tree)


def dict_list_map_outplace(fn: Callable, tree):
    """A copy of the dicts and lists of `tree` with `fn(leaf)` for each leaf; `tree` is left as it is."""
    if isinstance(tree, dict):
        return {key: dict_list_map_outplace(fn, value) for key, value in tree.items()}
    if isinstance(tree, list):
        return [dict_list_map_outplace(fn, value) for value in tree]
    return fn(tree)


def nested_values(tree) -> Iterator:
    """Every leaf of `tree`, depth first."""
    values = tree.values() if isinstance(tree, dict) else tree if isinstance(tree, list) else None
    if values is None:
        yield tree
        return
    for value in values:
        yield from nested_values(value)
