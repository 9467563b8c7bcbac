"""Import a script of `tools/` as a module (the scripts are not a package)."""

import importlib.util
import os

TOOLS_DIR = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, os.pardir, "tools"))


def load_tool(name, module_name=None):
    """`tools/<name>.py` loaded as a fresh module called `module_name` (default `tools_<name>`)."""
    spec = importlib.util.spec_from_file_location(module_name or f"tools_{name}", os.path.join(TOOLS_DIR, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
