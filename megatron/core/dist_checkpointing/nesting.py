"""Nested sharded state dicts, as training loops of their own build them for `api.save` / `api.load`:
`{"model": model.sharded_state_dict(), "optimizer": ..., "iteration": 10, "args": ...}`, with a virtual
pipeline `{"model0": ..., "model1": ...}`.

Dicts and lists are walked. A sharded entry (`ShardedLogicalTensor`, DTensor or `ShardedObject`) anywhere in
the nesting is one entry of the checkpoint under its own key: the key of the dict holding it (for an entry held by
a list, that key followed by the list indices, `"key.0"`; a ShardedTensor's `key`, a ShardedObject's
`unique_key`), not its position in the nesting, as upstream writes a ShardedTensor under its own key. So
`model.sharded_state_dict()`'s logical names stay the checkpoint's tensor names whether the dict is saved flat,
under "model" or split over "model0" / "model1", and the checkpoint loads at another pipeline layout. Two entries
of one rank under the same key are refused.

Everything else (numbers, strings, plain tensors, namespaces, ...) is the common state: each top-level entry
is one object, its dicts and lists kept with the sharded entries taken out (dropped from dicts, None in lists),
so that loading puts the filled entries back where they were asked for.
"""

from typing import Dict, NamedTuple, Tuple

from torch.distributed.tensor import DTensor

from megatron.core.dist_checkpointing.logical_tensor import ShardedLogicalTensor
from megatron.core.dist_checkpointing.mapping import ShardedObject, checkpoint_key

_TAKEN = object()  # stands for a sharded entry taken out of the common state


def is_sharded(value) -> bool:
    return isinstance(value, (ShardedLogicalTensor, DTensor, ShardedObject))


def _dotted(path) -> str:
    return ".".join(str(step) for step in path)


class Split(NamedTuple):
    sharded: Dict[str, object]  # own key -> sharded entry
    paths: Dict[str, Tuple]  # own key -> where the entry sits in the nesting
    common: Dict[str, object]  # top-level key -> its value without the sharded entries
    common_with_values: frozenset  # the top-level keys of `common` that hold more than empty containers


def split(state_dict) -> Split:
    """The sharded entries of a nested state dict by their own keys, and its common state by top-level key."""
    sharded, paths = {}, {}

    def take(value, path, own_key):
        if is_sharded(value):
            own_key = checkpoint_key(value, own_key)
            if own_key in sharded and sharded[own_key] is not value:
                raise ValueError(
                    f"sharded state dict: the entries at '{_dotted(paths[own_key])}' and '{_dotted(path)}' are both "
                    f"saved under the key '{own_key}' (a sharded entry is saved under the key of the dict holding "
                    "it, not its place in the nesting); give each tensor its own key")
            sharded[own_key], paths[own_key] = value, path
            return _TAKEN, False
        if isinstance(value, dict):
            kept, has_value = {}, False
            for key, item in value.items():
                rest, item_has_value = take(item, path + (key,), str(key))
                if rest is not _TAKEN:
                    kept[key] = rest
                has_value = has_value or item_has_value
            return kept, has_value
        if isinstance(value, list):
            kept, has_value = [], False
            for index, item in enumerate(value):
                rest, item_has_value = take(item, path + (index,), f"{own_key}.{index}")
                kept.append(None if rest is _TAKEN else rest)
                has_value = has_value or item_has_value
            return kept, has_value
        return value, True

    common, with_values = {}, set()
    for key, value in state_dict.items():
        rest, has_value = take(value, (key,), str(key))
        if rest is not _TAKEN:
            common[key] = rest
            if has_value:
                with_values.add(key)
    clashing = sorted(set(map(str, common)) & set(sharded))
    if clashing:
        key = clashing[0]
        raise ValueError(f"sharded state dict: '{key}' is both a top-level entry and the key of the sharded entry at "
                         f"'{_dotted(paths[key])}'; rename one of them")
    return Split(sharded, paths, common, frozenset(with_values))


def _empty_like(container):
    return [] if isinstance(container, list) else {}


def _child(node, step, template):
    """`node[step]`, made a container like `template` when the node lacks it (or holds no container there)."""
    if isinstance(node, list):
        node.extend([None] * (step + 1 - len(node)))
        if not isinstance(node[step], (dict, list)):
            node[step] = _empty_like(template)
        return node[step]
    if not isinstance(node.get(step), (dict, list)):
        node[step] = _empty_like(template)
    return node[step]


def _put(tree, request_tree, path, value):
    """Set `value` at `path` of `tree`, creating the containers on the way as the request has them."""
    node, template = tree, request_tree
    for step in path[:-1]:
        template = template[step]
        node = _child(node, step, template)
    if isinstance(node, list):
        node.extend([None] * (path[-1] + 1 - len(node)))
    node[path[-1]] = value


def assemble(request, request_split: Split, loaded_common, loaded_sharded) -> dict:
    """The request's nesting filled from a checkpoint: each top-level entry is the saved common object (the
    request's own value where the checkpoint has none), with the loaded sharded entries put back where the
    request holds them. Keys absent from both `loaded_*` dicts are left out."""
    result = {}
    for key, value in request.items():
        if is_sharded(value):
            if checkpoint_key(value, str(key)) in loaded_sharded:
                result[key] = loaded_sharded[checkpoint_key(value, str(key))]
        elif key in loaded_common:
            result[key] = loaded_common[key]
        elif isinstance(value, (dict, list)):
            result[key] = request_split.common[key]
    for own_key, path in request_split.paths.items():
        if len(path) == 1 or own_key not in loaded_sharded:
            continue
        top = path[0]
        if not isinstance(result.get(top), (dict, list)):
            result[top] = _empty_like(request[top])
        _put(result[top], request[top], path[1:], loaded_sharded[own_key])
    return result
