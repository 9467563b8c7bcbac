"""The safetensors file format, read and written with torch alone.

A file is an 8-byte little-endian header length, a JSON header `{name: {"dtype", "shape", "data_offsets":
[begin, end]}, "__metadata__": {str: str}}` padded with spaces to a multiple of 8 bytes, then the tensors'
raw little-endian bytes, `data_offsets` counting from the end of the header.
"""

import json
import struct
from typing import Dict, Optional, Tuple

import torch

DTYPE_NAMES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}


def _raw_bytes(tensor: torch.Tensor) -> bytes:
    tensor = tensor.detach().to("cpu").contiguous()
    if tensor.numel() == 0:
        return b""
    return tensor.reshape(-1).view(torch.uint8).numpy().tobytes()


def save_file(tensors: Dict[str, torch.Tensor], path: str, metadata: Optional[Dict[str, str]] = None):
    header, offset = {}, 0
    names = sorted(tensors)
    for name in names:
        tensor = tensors[name]
        if tensor.dtype not in DTYPE_NAMES:
            raise ValueError(f"tensor '{name}' has dtype {tensor.dtype}, which safetensors cannot store")
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    if metadata:
        header["__metadata__"] = {str(key): str(value) for key, value in metadata.items()}
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as stream:
        stream.write(struct.pack("<Q", len(encoded)))
        stream.write(encoded)
        for name in names:
            stream.write(_raw_bytes(tensors[name]))


def load_file(path: str) -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    """(tensors, metadata) of a safetensors file; errors name the file."""
    with open(path, "rb") as stream:
        data = stream.read()
    if len(data) < 8:
        raise ValueError(f"{path} is not a safetensors file (too short)")
    (header_size,) = struct.unpack("<Q", data[:8])
    if 8 + header_size > len(data):
        raise ValueError(f"{path}: header of {header_size} bytes runs past the end of the file (truncated?)")
    try:
        header = json.loads(data[8:8 + header_size])
    except ValueError as exc:
        raise ValueError(f"{path}: the safetensors header is not valid JSON ({exc})") from exc
    metadata = header.pop("__metadata__", {}) or {}
    body = memoryview(data)[8 + header_size:]
    tensors = {}
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        if end > len(body):
            raise ValueError(f"{path}: tensor '{name}' ends at byte {end} but the data has {len(body)} (truncated?)")
        dtype = DTYPES[entry["dtype"]]
        raw = torch.frombuffer(bytearray(body[begin:end]), dtype=torch.uint8) if end > begin else \
            torch.empty(0, dtype=torch.uint8)
        tensors[name] = raw.view(dtype).reshape(entry["shape"]).clone()
    return tensors, metadata
