"""Build the bundled text corpus from CPython's standard library documentation.

Every Python installation carries its standard library sources, and their documentation is under the PSF
licence, which allows redistribution with the licence notice. Each output document is either one module's
docstrings (module, classes, functions and methods, in source order, each under a short heading) or one
topic of the interactive help's language reference (`pydoc_data/topics.py`).

The output is deterministic for a given Python version: modules are visited in sorted order, sources are
parsed with `ast` (nothing is imported or executed), and JSON is written with sorted keys.

    python tools/build_corpus.py --output data/corpus/stdlib_docs.jsonl
"""

import argparse
import ast
import inspect
import json
import os
import shutil
import sys
import sysconfig

SKIPPED_DIRECTORIES = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "lib-dynload"}
TOPICS_MODULE = "pydoc_data.topics"
MIN_DOCUMENT_CHARS = 200
DEFAULT_MAX_BYTES = 3_000_000


def stdlib_modules(stdlib_dir):
    """(module name, source path) for every pure-Python stdlib module, sorted by module name."""
    modules = []
    for directory, subdirectories, filenames in os.walk(stdlib_dir):
        subdirectories[:] = [
            name for name in subdirectories if name not in SKIPPED_DIRECTORIES and not name.startswith("config-")
        ]
        for filename in filenames:
            if not filename.endswith(".py"):
                continue
            relative = os.path.relpath(os.path.join(directory, filename), stdlib_dir)
            parts = relative[: -len(".py")].split(os.sep)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules.append((".".join(parts), os.path.join(directory, filename)))
    return sorted(modules)


def _signature(function_node):
    try:
        return f"({ast.unparse(function_node.args)})"
    except Exception:  # unparse of exotic syntax is cosmetic; the docstring is what matters
        return "(...)"


def _docstring_sections(node, qualified_prefix):
    """(heading, docstring) for `node`'s classes and functions, depth first in source order."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = f"{qualified_prefix}.{child.name}"
            docstring = ast.get_docstring(child, clean=True)
            if docstring:
                if isinstance(child, ast.ClassDef):
                    heading = f"class {name}"
                else:
                    heading = f"def {name}{_signature(child)}"
                yield heading, docstring
            yield from _docstring_sections(child, name)


def module_document(module_name, source_path):
    """The documentation text of one module, or None when it has too little to be worth a document."""
    with open(source_path, "rb") as source_file:
        source = source_file.read()
    try:
        tree = ast.parse(source, filename=source_path)
    except (SyntaxError, ValueError):
        return None
    sections = []
    module_docstring = ast.get_docstring(tree, clean=True)
    if module_docstring:
        sections.append(f"Module {module_name}\n\n{module_docstring}")
    for heading, docstring in _docstring_sections(tree, module_name):
        sections.append(f"{heading}\n\n{docstring}")
    text = "\n\n".join(sections)
    return text if len(text) >= MIN_DOCUMENT_CHARS else None


def topic_documents(stdlib_dir):
    """(topic name, text) from the interactive help's reference topics, sorted by name."""
    path = os.path.join(stdlib_dir, *TOPICS_MODULE.split(".")) + ".py"
    if not os.path.isfile(path):
        return []
    with open(path, "rb") as source_file:
        tree = ast.parse(source_file.read(), filename=path)
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "topics" for t in node.targets):
            topics = ast.literal_eval(node.value)
            return sorted((name, inspect.cleandoc(text)) for name, text in topics.items())
    return []


def build_documents(stdlib_dir, module_prefixes=None):
    """All corpus documents in their fixed order: modules first, then reference topics.

    `module_prefixes` restricts the modules (e.g. ("json",) keeps json and json.*) and drops the topics.
    """
    documents = []
    for module_name, source_path in stdlib_modules(stdlib_dir):
        if module_name == TOPICS_MODULE:
            continue
        if module_prefixes and not any(
            module_name == prefix or module_name.startswith(prefix + ".") for prefix in module_prefixes
        ):
            continue
        text = module_document(module_name, source_path)
        if text is not None:
            documents.append({"source": f"module:{module_name}", "text": text})
    if not module_prefixes:
        for name, text in topic_documents(stdlib_dir):
            if len(text) >= MIN_DOCUMENT_CHARS:
                documents.append({"source": f"topic:{name}", "text": f"Topic {name}\n\n{text}"})
    return documents


def write_jsonl(documents, output_path, max_bytes):
    """Write documents in order until the next one would pass `max_bytes`; returns (count, bytes)."""
    written_count, written_bytes = 0, 0
    with open(output_path, "w", encoding="utf-8", newline="\n") as output_file:
        for document in documents:
            line = json.dumps(document, ensure_ascii=False, sort_keys=True) + "\n"
            size = len(line.encode("utf-8"))
            if written_bytes + size > max_bytes:
                break
            output_file.write(line)
            written_count, written_bytes = written_count + 1, written_bytes + size
    return written_count, written_bytes


def copy_python_licence(stdlib_dir, output_dir):
    """Ship the PSF licence text of the Python the corpus came from, as the licence asks."""
    licence_path = os.path.join(stdlib_dir, "LICENSE.txt")
    if os.path.isfile(licence_path):
        shutil.copyfile(licence_path, os.path.join(output_dir, "PYTHON_LICENSE.txt"))
        return True
    return False


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True, help="output JSONL path (one {'text': ...} document per line)")
    parser.add_argument("--stdlib-dir", default=sysconfig.get_paths()["stdlib"], help="standard library root")
    parser.add_argument("--modules", nargs="*", default=None, help="only these modules (and their submodules)")
    parser.add_argument("--max-bytes", type=int, default=DEFAULT_MAX_BYTES, help="stop before the file passes this")
    parser.add_argument("--no-licence-copy", action="store_true", help="do not copy Python's LICENSE.txt alongside")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if not os.path.isdir(args.stdlib_dir):
        raise SystemExit(f"build_corpus.py: --stdlib-dir {args.stdlib_dir!r} is not a directory; give the standard "
                         "library root (the default is this Python's)")
    documents = build_documents(args.stdlib_dir, args.modules)
    if not documents:
        if args.modules:
            reason = (f"--modules {' '.join(args.modules)} names no module under --stdlib-dir {args.stdlib_dir} "
                      f"with at least {MIN_DOCUMENT_CHARS} characters of docstrings; name standard library modules "
                      "(such as json csv)")
        else:
            reason = (f"--stdlib-dir {args.stdlib_dir} holds no Python module with at least {MIN_DOCUMENT_CHARS} "
                      "characters of docstrings; give the standard library root")
        raise SystemExit(f"build_corpus.py: {reason}; nothing was written")
    first_size = len((json.dumps(documents[0], ensure_ascii=False, sort_keys=True) + "\n").encode("utf-8"))
    if args.max_bytes < first_size:
        raise SystemExit(f"build_corpus.py: --max-bytes {args.max_bytes} is smaller than the first document "
                         f"({documents[0]['source']}, {first_size} bytes); give at least that; nothing was written")
    output_dir = os.path.dirname(os.path.abspath(args.output))
    os.makedirs(output_dir, exist_ok=True)
    count, size = write_jsonl(documents, args.output, args.max_bytes)
    if not args.no_licence_copy:
        copy_python_licence(args.stdlib_dir, output_dir)
    version = ".".join(str(part) for part in sys.version_info[:3])
    print(f"wrote {count} of {len(documents)} documents ({size / 1e6:.2f} MB) from Python {version} to {args.output}")
    return count, size


if __name__ == "__main__":
    main()
