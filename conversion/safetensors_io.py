"""Minimal, strict safetensors reader / writer for streaming conversion.

Why not `safetensors.safe_open`: the converter needs (1) a strict check of every file before any byte is written
(truncation, overlapping or gapped offsets, unknown dtypes), (2) to read one tensor -- or one byte range of one
tensor -- at a time through plain `readinto`, so that peak memory is a small, known constant and not the page cache
of a memory-mapped 5 GB shard, and (3) to write an output shard whose header is known in advance into a
preallocated file at arbitrary offsets (`os.pwrite`), so that fused tensors assembled from many source tensors
never need a staging buffer.

File format (https://github.com/huggingface/safetensors, "Format" section): 8 bytes little-endian u64 N, then N
bytes of UTF-8 JSON header {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}},
then the data buffer. Offsets are relative to the start of the data buffer, tensors are C-contiguous little-endian,
and the tensors must tile the buffer exactly (no gaps, no overlaps).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass

import torch

# safetensors dtype string -> (torch dtype, itemsize in bytes)
DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "F64": (torch.float64, 8),
    "F32": (torch.float32, 4),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
    "I64": (torch.int64, 8),
    "I32": (torch.int32, 4),
    "I16": (torch.int16, 2),
    "I8": (torch.int8, 1),
    "U8": (torch.uint8, 1),
    "BOOL": (torch.bool, 1),
    "F8_E4M3": (torch.float8_e4m3fn, 1),
    "F8_E5M2": (torch.float8_e5m2, 1),
}
TORCH_TO_ST = {v[0]: k for k, v in DTYPES.items()}
# names used in config.json "dtype" fields
CONFIG_DTYPE_TO_ST = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "float64": "F64"}
MAX_HEADER = 100 * 1024 * 1024  # the reference implementation refuses larger headers too


class SafetensorsError(ValueError):
    """A safetensors file is malformed, truncated or inconsistent."""


def itemsize(dtype: str) -> int:
    try:
        return DTYPES[dtype][1]
    except KeyError:
        raise SafetensorsError(f"unsupported safetensors dtype {dtype!r}") from None


def numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


@dataclass(frozen=True)
class TensorInfo:
    """One tensor entry of a safetensors header. `begin` / `end` are absolute file offsets."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass
class FileHeader:
    path: str
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    data_start: int
    file_size: int


def read_header(path: str) -> FileHeader:
    """Parse and fully validate the header of one safetensors file (reads only the header bytes).

    Raises SafetensorsError naming the file for: short file, absurd header size, invalid JSON, unknown dtype,
    byte size != numel * itemsize, gaps / overlaps between tensors, and a data section shorter (truncated file) or
    longer than the header says.
    """
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise SafetensorsError(f"{path}: truncated safetensors file ({size} bytes, no header length)")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER or 8 + n > size:
            raise SafetensorsError(f"{path}: truncated or corrupt safetensors file (header length {n}, file size {size})")
        raw = f.read(n)
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SafetensorsError(f"{path}: header is not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise SafetensorsError(f"{path}: header is not a JSON object")
    metadata = obj.pop("__metadata__", None) or {}
    data_start = 8 + n
    entries = []
    for name, e in obj.items():
        try:
            dtype, shape, (b, en) = e["dtype"], tuple(int(s) for s in e["shape"]), e["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise SafetensorsError(f"{path}: malformed header entry for {name!r}: {e!r}") from None
        want = numel(shape) * itemsize(dtype)
        if en - b != want or b < 0:
            raise SafetensorsError(
                f"{path}: tensor {name!r} dtype {dtype} shape {list(shape)} needs {want} bytes, header gives {en - b}"
            )
        entries.append(TensorInfo(name, dtype, shape, data_start + b, data_start + en))
    entries.sort(key=lambda t: (t.begin, t.end))
    pos = data_start
    for t in entries:
        if t.begin != pos:
            raise SafetensorsError(f"{path}: tensor {t.name!r} starts at data offset {t.begin - data_start}, expected "
                                   f"{pos - data_start} (gap or overlap in the data section)")
        pos = t.end
    if size < pos:
        raise SafetensorsError(f"{path}: truncated safetensors file: header needs {pos} bytes, file has {size}")
    if size > pos:
        raise SafetensorsError(f"{path}: {size - pos} trailing bytes after the last tensor")
    return FileHeader(path, {t.name: t for t in entries}, dict(metadata), data_start, size)


def read_bytes(f, begin: int, nbytes: int, out: bytearray | memoryview | None = None) -> memoryview:
    """Read exactly `nbytes` bytes at absolute offset `begin` of an open binary file."""
    buf = memoryview(out)[:nbytes] if out is not None else memoryview(bytearray(nbytes))
    f.seek(begin)
    got = 0
    while got < nbytes:
        k = f.readinto(buf[got:])
        if not k:
            raise SafetensorsError(f"{getattr(f, 'name', '?')}: unexpected end of file at offset {begin + got}")
        got += k
    return buf


def bytes_to_tensor(buf, dtype: str, shape) -> torch.Tensor:
    """Zero-copy view of raw little-endian bytes as a torch tensor (the buffer must stay alive)."""
    tdtype, isz = DTYPES[dtype]
    if len(buf) == 0:
        return torch.empty(tuple(shape), dtype=tdtype)
    return torch.frombuffer(buf, dtype=tdtype, count=len(buf) // isz).reshape(tuple(shape))


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """Raw bytes of a CPU tensor (made contiguous), as a memoryview."""
    t = t.detach().contiguous().cpu()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


@dataclass
class PlannedTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return numel(self.shape) * itemsize(self.dtype)


class PreallocatedShard:
    """An output safetensors file whose header is written first; tensor bytes are then written with `pwrite` at
    their planned offsets, in any order. Tensors are ordered by decreasing itemsize (then in the given order), so every tensor
    starts at an offset aligned to its itemsize (the header is padded with spaces to a multiple of 8)."""

    def __init__(self, path: str, tensors: list[PlannedTensor], metadata: dict[str, str] | None = None):
        self.path = path
        # stable: keep the caller's order (the order in which the converter completes them, so writes are mostly
        # sequential) inside each itemsize class
        order = sorted(tensors, key=lambda t: -itemsize(t.dtype))
        header: dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
        pos = 0
        self.offsets: dict[str, tuple[int, int]] = {}
        for t in order:
            header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [pos, pos + t.nbytes]}
            self.offsets[t.name] = (pos, pos + t.nbytes)
            pos += t.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * ((-len(raw)) % 8)
        self.data_start = 8 + len(raw)
        self.size = self.data_start + pos
        self.written: dict[str, int] = {t.name: 0 for t in order}
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        os.pwrite(self.fd, struct.pack("<Q", len(raw)) + raw, 0)
        os.ftruncate(self.fd, self.size)

    def write(self, name: str, rel_offset: int, data) -> None:
        """Write `data` (bytes-like) at byte `rel_offset` inside tensor `name`."""
        b, e = self.offsets[name]
        mv = memoryview(data).cast("B")
        if rel_offset < 0 or b + rel_offset + len(mv) > e:
            raise SafetensorsError(f"write out of bounds for {name!r}: offset {rel_offset} + {len(mv)} > {e - b}")
        pos = self.data_start + b + rel_offset
        done = 0
        while done < len(mv):
            done += os.pwrite(self.fd, mv[done:], pos + done)
        self.written[name] += len(mv)

    def close(self) -> None:
        if self.fd is not None:
            os.fsync(self.fd)
            os.close(self.fd)
            self.fd = None
