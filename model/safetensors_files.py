"""A model directory's safetensors files (one or sharded), memory-mapped, read one tensor at a
time: what model/gguf/tensors.py is for a GGUF.

The reader is our own (the format is a JSON header and raw bytes) for two reasons: NumPy has no
bfloat16, which most Hugging Face checkpoints use, and a truncated or corrupt file must become
one clear line rather than a deep library traceback. A tensor is converted only when read, into
the array that goes to the ops, and its mapped pages are handed back to the page cache once
read; an embedding and LM head go unread (FloatRows), for packing ops to read a slab of rows at
a time.
"""

import json
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from model.errors import ModelError
from model.quant.quantized import FloatRows

_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64, "I32": np.int32,
           "F8_E4M3": np.uint8}
# safetensors dtypes that hold quantized weights (FP8, or integers packing GPTQ, AWQ,
# bitsandbytes or compressed-tensors codes): refused by name, not as corruption
_QUANTIZED_DTYPES = {"F8_E4M3": "FP8", "F8_E5M2": "FP8", "I8": "8-bit integer",
                     "U8": "packed integer", "I32": "packed integer"}


def _corrupt(path: Path, why: str) -> ModelError:
    return ModelError(
        f"{path} is corrupt or truncated ({why}); delete it and re-download or re-convert the model"
    )


@dataclass(frozen=True)
class _Entry:
    path: Path
    dtype: str  # the file's name for it: F32, F16, BF16, F64
    shape: tuple
    begin: int  # byte offsets in the file
    end: int


def _read_header(path: Path, allowed: tuple[str, ...] = ()) -> dict[str, _Entry]:
    """Every tensor's place in one file, checked against the file's size; quantized dtypes only
    where allowed (an AWQ or GPTQ checkpoint's I32, model/quant/awq_gptq.py; an FP8 one's
    F8_E4M3, model/quant/fp8.py)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise _corrupt(path, "no header")
            (header_len,) = struct.unpack("<Q", head)
            if header_len > min(size - 8, 100 << 20):
                raise _corrupt(path, "header length past the end of the file")
            header = json.loads(f.read(header_len))
    except (ValueError, UnicodeDecodeError) as e:
        raise _corrupt(path, f"unreadable header: {e}") from None
    except OSError as e:
        raise ModelError(f"cannot read {path} ({e.strerror}); check the path and its permissions") from None
    if not isinstance(header, dict):
        raise _corrupt(path, "header is not a JSON object")
    data_start = 8 + header_len
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = info["dtype"]
            if dtype in _QUANTIZED_DTYPES and dtype not in allowed:
                raise ModelError(
                    f"{path} holds {_QUANTIZED_DTYPES[dtype]} weights (tensor {name!r} is {dtype}),"
                    " which Spool cannot load; use the original F16/BF16 checkpoint or a GGUF file"
                )
            itemsize = np.dtype(_DTYPES[dtype]).itemsize
            begin, end = info["data_offsets"]
            shape = tuple(int(n) for n in info["shape"])
        except (KeyError, TypeError, ValueError):
            raise _corrupt(path, f"bad entry for tensor {name!r}") from None
        if data_start + end > size:
            raise _corrupt(path, f"tensor {name!r} runs past the end of the file")
        if end - begin != int(np.prod(shape, dtype=np.int64)) * itemsize:
            raise _corrupt(path, f"tensor {name!r} has {end - begin} bytes for shape {shape}")
        entries[name] = _Entry(path, dtype, shape, data_start + begin, data_start + end)
    return entries


# where other checkpoints keep the causal LM's "model." tensors: a base model's (Qwen3-Embedding
# saves its Qwen3Model), and a vision-language model's language model (Gemma 3 4B-27B, as
# transformers 4 and 5 save it; the vision tower's tensors are left unread)
_MODEL_PREFIXES = ("", "language_model.model.", "model.language_model.")


def _causal_lm_names(entries: dict) -> dict:
    if "model.embed_tokens.weight" in entries:
        return entries
    for prefix in _MODEL_PREFIXES:
        if prefix + "embed_tokens.weight" in entries:
            return {name if name == "lm_head.weight" else "model." + name[len(prefix):]: e
                    for name, e in entries.items() if name.startswith(prefix) or name == "lm_head.weight"}
    return entries


class ModelTensors:
    """The tensors of a model directory's safetensors files (one or sharded), memory-mapped;
    read_into converts one tensor at a time. Use as a context manager: the maps close on exit."""

    def __init__(self, model_dir: Path, allowed: tuple[str, ...] = ()):
        files = sorted(Path(model_dir).glob("*.safetensors"))
        if not files:
            raise ModelError(
                f"{model_dir} has no .safetensors weights; convert the checkpoint to safetensors"
                " or pass --model with a .gguf file"
            )
        self.entries: dict[str, _Entry] = {}
        for path in files:
            self.entries.update(_read_header(path, allowed))
        self.entries = _causal_lm_names(self.entries)
        self.maps: dict[Path, mmap.mmap] = {}

    norms_include_one = False  # unit-offset norms (Family.unit_offset_norms) as checkpoints store them: w

    def __enter__(self) -> "ModelTensors":
        return self

    def __exit__(self, *_) -> None:
        for m in self.maps.values():
            m.close()
        self.maps.clear()

    def read_into(self, name: str, out: np.ndarray, first: int = 0) -> None:
        """Tensor `name` (its rows first .. first + len(out), where out holds fewer), converted to
        out's dtype (float32 from BF16 with no temporary), then those mapped pages dropped from
        this process (the page cache keeps them)."""
        self.read_entry(self.entries[name], out, first)

    def read_entry(self, e: _Entry, out: np.ndarray, first: int = 0) -> None:
        """read_into for an entry, whether or not entries shows it."""
        m = self.maps.get(e.path)
        if m is None:
            with open(e.path, "rb") as f:
                m = self.maps[e.path] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        dtype = np.dtype(_DTYPES[e.dtype])
        begin = e.begin + first * int(np.prod(e.shape[1:], dtype=np.int64)) * dtype.itemsize
        end = begin + out.size * dtype.itemsize
        raw = np.frombuffer(m, dtype=dtype, count=out.size, offset=begin).reshape(out.shape)
        if e.dtype == "BF16":
            bits = out.view(np.uint32)
            bits[...] = raw
            bits <<= 16
        else:
            out[...] = raw
        del raw  # the buffer export, so that the map can close
        if hasattr(m, "madvise"):
            start = begin - begin % mmap.PAGESIZE
            m.madvise(mmap.MADV_DONTNEED, start, end - start)

    def rows(self, name: str) -> FloatRows:
        """Tensor `name` unread, for ops.weight to take a slab of rows at a time."""
        return FloatRows(self.entries[name].shape, lambda first, out: self.read_into(name, out, first))

    def quantized(self, name: str) -> bool:
        """Never: safetensors hold float tensors only."""
        return False

    def read(self, name: str) -> np.ndarray:
        out = np.empty(self.entries[name].shape, dtype=np.float32)
        self.read_into(name, out)
        return out
