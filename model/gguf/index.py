"""A GGUF file's tensor table and scalar metadata, read straight from its header.

gguf's GGUFReader builds NumPy objects for every metadata value, the vocabulary's hundreds of
thousands of strings included: 3 s for the default model's 49k tokens on every start. Serving
a GGUF in place needs only where each tensor is and a few scalars, so the header is walked
here: strings and arrays are skipped over, not read.
"""

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from model.errors import ModelError, one_line

# GGUF metadata value types -> struct format, for the fixed-size ones
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's entry: what names.py needs of gguf's ReaderTensor, and where its bytes are."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray  # gguf's order, columns first, as ReaderTensor's
    data_offset: int  # in the file
    n_bytes: int


def read_index(path: Path) -> tuple[dict[str, Any], list[TensorInfo]]:
    """The file's scalar and string metadata (arrays left out) and its tensors; ModelError, in
    one line, for a file that is not a complete GGUF."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return _walk(m, len(m))  # only the header's pages are read
    except OSError as exc:
        raise ModelError(f"cannot read {path} ({one_line(exc)}); check the path and its permissions") from None
    except (struct.error, ValueError, KeyError, UnicodeDecodeError) as exc:
        raise ModelError(
            f"{path} is not a readable GGUF file ({one_line(exc) or type(exc).__name__});"
            " it may be truncated or not a GGUF: re-download it"
        ) from None


def _walk(buf: mmap.mmap, size: int) -> tuple[dict[str, Any], list[TensorInfo]]:
    import gguf

    magic, version = struct.unpack_from("<II", buf, 0)
    if magic != gguf.GGUF_MAGIC or version < 2:
        raise ValueError(f"magic {magic:#x}, version {version}")
    n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
    at = 24

    def string() -> str:
        nonlocal at
        (n,) = struct.unpack_from("<Q", buf, at)
        if at + 8 + n > size:
            raise ValueError("a string runs past the end of the file")
        at += 8 + n
        return buf[at - n:at].decode()

    def skip_array() -> None:
        nonlocal at
        kind, count = struct.unpack_from("<IQ", buf, at)
        at += 12
        if kind in _SCALARS:
            at += count * struct.calcsize(_SCALARS[kind])
        elif kind == _STRING:
            for _ in range(count):
                at += 8 + struct.unpack_from("<Q", buf, at)[0]
        elif kind == _ARRAY:
            for _ in range(count):
                skip_array()
        else:
            raise ValueError(f"unknown array type {kind}")

    fields: dict[str, Any] = {}
    for _ in range(n_kv):
        key = string()
        (kind,) = struct.unpack_from("<I", buf, at)
        at += 4
        if kind in _SCALARS:
            (fields[key],) = struct.unpack_from("<" + _SCALARS[kind], buf, at)
            at += struct.calcsize(_SCALARS[kind])
        elif kind == _STRING:
            fields[key] = string()
        elif kind == _ARRAY:
            skip_array()
        else:
            raise ValueError(f"unknown metadata type {kind} for {key}")
    infos = []
    for _ in range(n_tensors):
        name = string()
        (dims,) = struct.unpack_from("<I", buf, at)
        shape = np.array(struct.unpack_from(f"<{dims}Q", buf, at + 4), dtype=np.int64)
        kind, offset = struct.unpack_from("<IQ", buf, at + 4 + 8 * dims)
        at += 4 + 8 * dims + 12
        tensor_type = gguf.GGMLQuantizationType(kind)
        block, block_bytes = gguf.GGML_QUANT_SIZES[tensor_type]
        infos.append(TensorInfo(name, tensor_type, shape, offset, int(np.prod(shape)) * block_bytes // block))
    alignment = int(fields.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT))
    start = -(-at // alignment) * alignment
    infos = [TensorInfo(t.name, t.tensor_type, t.shape, start + t.data_offset, t.n_bytes) for t in infos]
    for t in infos:
        if t.data_offset + t.n_bytes > size:
            raise ValueError(f"tensor {t.name} runs past the end of the file")
    return fields, infos
