"""No import cycle through the FP8 code: `extensions/transformer_engine.py` imports the tensor-parallel layers,
which import the FP8 region, linear and scaling modules; none of those may import the backend back. Counts every
import statement, at module level and inside functions."""

import ast
import os

import megatron

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(megatron.__file__)))
WATCHED = ("megatron.core.extensions.transformer_engine", "megatron.core.tensor_parallel.layers",
           "megatron.core.fp8_utils")


def _module_file(name):
    base = os.path.join(ROOT, *name.split("."))
    for path in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.exists(path):
            return path
    return None


def _imports(name):
    """Modules of this repository imported anywhere in module `name` (`from pkg import sub` counts `pkg.sub`)."""
    tree = ast.parse(open(_module_file(name)).read())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            candidates = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            continue
        for candidate in candidates:
            if candidate.startswith("megatron.") and _module_file(candidate) is not None:
                found.add(candidate)
                break
    return found


def _graph(start, prefix="megatron.core"):
    graph, todo = {}, list(start)
    while todo:
        name = todo.pop()
        if name in graph:
            continue
        graph[name] = {dep for dep in _imports(name) if dep.startswith(prefix) and not dep.endswith("__init__")}
        todo.extend(graph[name])
    return graph


def _reaches(graph, source, target):
    seen, todo = set(), [source]
    while todo:
        name = todo.pop()
        for dep in graph.get(name, ()):
            if dep == target:
                return True
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return False


def test_no_import_cycle_through_the_fp8_modules():
    fp8_modules = [f"megatron.core.fp8.{os.path.splitext(f)[0]}"
                   for f in sorted(os.listdir(os.path.join(ROOT, "megatron", "core", "fp8"))) if f.endswith(".py")
                   and f != "__init__.py"]
    watched = [*WATCHED, *fp8_modules]
    graph = _graph(watched)
    cycles = [name for name in watched if _reaches(graph, name, name)]
    assert cycles == [], f"modules on an import cycle: {cycles}"
    # The chain named in the layering: backend -> layers -> FP8 modules, and never back.
    assert _reaches(graph, "megatron.core.extensions.transformer_engine", "megatron.core.tensor_parallel.layers")
    assert _reaches(graph, "megatron.core.tensor_parallel.layers", "megatron.core.fp8.region")
    assert not _reaches(graph, "megatron.core.tensor_parallel.layers", "megatron.core.extensions.transformer_engine")
