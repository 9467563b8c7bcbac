"""Print what a checkpoint holds: iteration, the layout and wrapper that wrote it, every tensor's logical name,
shape, dtype and number of saved chunks, and the bytes on disk.

    python tools/checkpoint/inspect_checkpoint.py CHECKPOINT_ROOT_OR_ITER_DIR [--filter SUBSTRING]

The iteration and layout come from the checkpoint's metadata.json, or, where that summary is absent (it is
written when the checkpoint is published, so a copied or hand-assembled directory may lack it), from the
`common` entry every checkpoint holds. A legacy `--ckpt-format torch` directory is named as such, with the
command that converts it.
"""

import argparse
import json
import os

import _paths  # noqa: F401  (repository on sys.path)


CONVERT_LEGACY = os.path.join("tools", "checkpoint", "convert_legacy.py")


def _legacy_rank_dirs(directory):
    return sorted(name for name in os.listdir(directory)
                  if name.startswith("mp_rank_") and os.path.isdir(os.path.join(directory, name)))


def _describe_legacy(root, directory, rank_dirs, out):
    out(f"checkpoint: {directory}")
    out(f"legacy --ckpt-format torch checkpoint: one directory per model-parallel rank ({', '.join(rank_dirs)}), "
        "not the logical torch_dist format; its tensors are listed after conversion. Convert it with:")
    out(f"  python {CONVERT_LEGACY} --input {root} --output NEW_ROOT")
    for name in rank_dirs:
        for file in sorted(os.listdir(os.path.join(directory, name))):
            out(f"  {name}/{file}  {os.path.getsize(os.path.join(directory, name, file))} bytes")
    return []


def _summary(directory):
    """(iteration, layout) from metadata.json, else from the checkpoint's `common` entry."""
    from megatron.core.dist_checkpointing import offline

    summary_path = os.path.join(directory, "metadata.json")
    if os.path.isfile(summary_path):
        with open(summary_path) as stream:
            summary = json.load(stream)
        return summary.get("iteration", "?"), summary.get("layout", {}), "metadata.json"
    common = offline.read_checkpoint(directory, keys={"common"}).get("common") or {}
    return common.get("iteration", "?"), common.get("layout", {}), "the checkpoint's common entry (no metadata.json)"


def inspect(directory, name_filter=None, out=print):
    from megatron.core.dist_checkpointing import offline

    root = directory
    directory = _paths.resolve_iteration_dir(directory, flag="checkpoint")
    rank_dirs = _legacy_rank_dirs(directory)
    if rank_dirs and not os.path.isfile(os.path.join(directory, ".metadata")):
        return _describe_legacy(root, directory, rank_dirs, out)
    directory = _paths.logical_checkpoint_dir(root, flag="checkpoint")
    iteration, layout, source = _summary(directory)
    out(f"checkpoint: {directory}")
    out(f"iteration: {iteration}")
    out(f"layout (from {source}):")
    for key, value in layout.items():
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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint")
    parser.add_argument("--filter", default=None, help="Only list keys containing this text.")
    options = parser.parse_args(argv)
    inspect(options.checkpoint, options.filter)


if __name__ == "__main__":
    main()
