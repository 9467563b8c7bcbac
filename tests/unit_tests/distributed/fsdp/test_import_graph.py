"""The package's modules import each other without cycles, counting imports inside functions too (a lazy import
hides a cycle from Python, not from the reader): data flows one way, layout -> buffers -> schedule -> API."""

import ast
import os

import megatron_fsdp

PACKAGE_DIR = os.path.dirname(megatron_fsdp.__file__)


def _intra_package_imports():
    graph = {}
    for file_name in sorted(os.listdir(PACKAGE_DIR)):
        if not file_name.endswith(".py") or file_name == "__init__.py":
            continue
        module = file_name[:-3]
        tree = ast.parse(open(os.path.join(PACKAGE_DIR, file_name)).read())
        targets = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                if node.module:
                    targets.add(node.module.split(".")[0])
                else:  # from . import collectives
                    targets.update(alias.name for alias in node.names)
        graph[module] = targets - {module}
    return graph


def _find_cycle(graph):
    state, stack = {}, []

    def visit(module):
        state[module] = "open"
        stack.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == "open":
                return stack[stack.index(target):] + [target]
            if target not in state:
                cycle = visit(target)
                if cycle:
                    return cycle
        state[module] = "done"
        stack.pop()
        return None

    for module in sorted(graph):
        if module not in state:
            cycle = visit(module)
            if cycle:
                return cycle
    return None


def test_no_import_cycles():
    graph = _intra_package_imports()
    assert {"megatron_fsdp", "optimizer", "state_dict", "schedule"} <= set(graph)
    assert _find_cycle(graph) is None, " -> ".join(_find_cycle(graph))
