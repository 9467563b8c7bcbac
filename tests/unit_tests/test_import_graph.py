"""No import circle anywhere in `megatron/`: every module's imports of this repository's modules, at module level and
inside functions (a lazy import hides a circle from Python, not from the reader), form a graph without cycles."""

import ast
import os

import megatron

PACKAGE_ROOT = os.path.dirname(os.path.abspath(megatron.__file__))


def _module_files():
    files = {}
    for directory, _, names in os.walk(PACKAGE_ROOT):
        for name in names:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                parts = os.path.relpath(path[:-3], os.path.dirname(PACKAGE_ROOT)).split(os.sep)
                files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def _import_graph(files):
    graph = {}
    for module, path in files.items():
        targets = set()
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names if alias.name in files)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    submodule = f"{node.module}.{alias.name}"
                    if submodule in files:
                        targets.add(submodule)
                    elif node.module in files:
                        targets.add(node.module)
        graph[module] = targets - {module}
    return graph


def _cycles(graph):
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, components, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return components


def test_the_cycle_finder_finds_a_planted_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_no_import_circle_in_megatron():
    files = _module_files()
    assert "megatron.core.pipeline_parallel.schedules" in files and len(files) > 100
    assert _cycles(_import_graph(files)) == []
