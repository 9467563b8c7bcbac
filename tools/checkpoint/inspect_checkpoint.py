"""Print what a checkpoint holds: iteration, the layout and wrapper that wrote it, every tensor's logical name,
shape, dtype and number of saved chunks, and the bytes on disk.

    python tools/checkpoint/inspect_checkpoint.py CHECKPOINT_ROOT_OR_ITER_DIR [--filter SUBSTRING]
"""

import argparse
import json
import os

import _paths  # noqa: F401  (repository on sys.path)


def inspect(directory, name_filter=None, out=print):
    from megatron.core.dist_checkpointing import offline

    directory = _paths.resolve_iteration_dir(directory)
    summary_path = os.path.join(directory, "metadata.json")
    summary = json.load(open(summary_path)) if os.path.isfile(summary_path) else {}
    out(f"checkpoint: {directory}")
    out(f"iteration: {summary.get('iteration', '?')}")
    for key, value in summary.get("layout", {}).items():
        out(f"  {key}: {value}")
    rows = offline.describe(directory)
    tensors = [row for row in rows if row[1] is not None]
    out(f"{len(tensors)} tensors, {len(rows) - len(tensors)} objects")
    width = max((len(row[0]) for row in rows), default=10)
    for key, shape, dtype, chunks in rows:
        if name_filter and name_filter not in key:
            continue
        shape_text = "" if shape is None else "x".join(map(str, shape)) or "scalar"
        out(f"  {key:<{width}}  {dtype:<9} {shape_text:<16} chunks={chunks}")
    on_disk = sum(os.path.getsize(os.path.join(directory, name)) for name in os.listdir(directory))
    out(f"bytes on disk: {on_disk}")
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint")
    parser.add_argument("--filter", default=None, help="Only list keys containing this text.")
    options = parser.parse_args()
    inspect(options.checkpoint, options.filter)


if __name__ == "__main__":
    main()
