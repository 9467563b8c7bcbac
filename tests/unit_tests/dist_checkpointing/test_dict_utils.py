"""Upstream's nested-state-dict helpers: `dict_list_map_inplace`, `dict_list_map_outplace`, `nested_values`."""

from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, dict_list_map_outplace, nested_values


def test_map_inplace_walks_dicts_and_lists():
    tree = {"a": 1, "b": [2, {"c": 3}], "d": {}}
    inner = tree["b"]
    assert dict_list_map_inplace(lambda value: value * 10, tree) is tree
    assert tree == {"a": 10, "b": [20, {"c": 30}], "d": {}} and tree["b"] is inner
    assert dict_list_map_inplace(lambda value: value + 1, 4) == 5


def test_map_outplace_and_nested_values_leave_the_tree():
    tree = {"a": 1, "b": [2, {"c": 3}]}
    assert dict_list_map_outplace(str, tree) == {"a": "1", "b": ["2", {"c": "3"}]}
    assert tree == {"a": 1, "b": [2, {"c": 3}]}
    assert list(nested_values(tree)) == [1, 2, 3]
