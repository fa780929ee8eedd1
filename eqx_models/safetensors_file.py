"""Safetensors files: reading tensors into caller-owned buffers, mapping page-aligned
ones without a copy, and writing files whose tensors are page-aligned.

The format is an 8-byte little-endian header length, a JSON header of
`{name: {dtype, shape, data_offsets}}` (offsets relative to the end of the header),
then the tensors' bytes, back to back with no gaps.
"""

import ctypes
import json
import math
import mmap
import os
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

# Most bytes held at once while reading part of each row of a tensor (a device's
# block of a weight split along its columns).
PART_CHUNK_BYTES = 32 * 2**20


class CheckpointError(ValueError):
    """A checkpoint whose tensors do not match the model its config describes."""


SAFETENSORS_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


class SafetensorsFile:
    """One safetensors file: its tensors read into caller-owned buffers, or found
    where they can be mapped.

    Reading with positional reads (no memory map) keeps file pages out of this
    process's resident memory, and every offset is checked against the file size up
    front, so a truncated download is reported before anything is loaded.
    """

    def __init__(self, path: Path):
        self.path = path
        size = path.stat().st_size
        try:
            self.handle = open(path, "rb", buffering=0)
            (header_length,) = struct.unpack("<Q", self.handle.read(8))
            if header_length > size - 8:
                raise ValueError(f"the header claims {header_length} bytes but the file has {size}")
            header = json.loads(self.handle.read(header_length))
        except (struct.error, ValueError, UnicodeDecodeError) as e:
            raise CheckpointError(
                f"{path} is not a readable safetensors file ({e}); it may be truncated or corrupt. "
                "Delete it and download it again."
            ) from e
        header.pop("__metadata__", None)
        self.data_start = 8 + header_length
        self.entries: dict[str, tuple[np.dtype, tuple[int, ...], int]] = {}
        for name, info in header.items():
            if info["dtype"] not in SAFETENSORS_DTYPES:
                raise CheckpointError(f"{path}: tensor {name} has dtype {info['dtype']}, which is not supported.")
            dtype = np.dtype(SAFETENSORS_DTYPES[info["dtype"]])
            shape = tuple(info["shape"])
            begin, end = info["data_offsets"]
            if end - begin != math.prod(shape) * dtype.itemsize or self.data_start + end > size:
                raise CheckpointError(
                    f"{path} is truncated or corrupt: tensor {name} should occupy bytes "
                    f"{self.data_start + begin}-{self.data_start + end} but the file has {size}. "
                    "Delete it and download it again."
                )
            self.entries[name] = (dtype, shape, begin)

    def read_into(self, name: str, out: np.ndarray, rows: range | None = None) -> None:
        """Fills `out` (C-contiguous, any dtype) with tensor `name`, or with its
        `rows` (a step-1 range along its first axis, which are contiguous bytes)."""
        dtype, shape, begin = self.entries[name]
        if rows is not None and shape:
            row_bytes = math.prod(shape[1:]) * dtype.itemsize
            begin += rows.start * row_bytes
            shape = (len(rows), *shape[1:])
        buffer = out if out.dtype == dtype else np.empty(shape, dtype)
        view = memoryview(buffer.reshape(-1).view(np.uint8))
        filled = 0
        while filled < len(view):  # one read returns at most ~2 GiB on Linux
            # Positional reads: tensors of one file are read from several threads.
            count = os.preadv(self.handle.fileno(), [view[filled:]], self.data_start + begin + filled)
            if not count:
                raise CheckpointError(f"{self.path} ended early while reading {name}; it may be truncated.")
            filled += count
        if buffer is not out:
            out[...] = buffer

    def file_range(self, name: str) -> tuple[int, int]:
        """`(offset in the file, byte count)` of tensor `name`."""
        dtype, shape, begin = self.entries[name]
        return self.data_start + begin, math.prod(shape) * dtype.itemsize


class TensorSource:
    """Where each tensor of a (possibly sharded) checkpoint lives."""

    def __init__(self, files: list[Path]):
        self.location: dict[str, SafetensorsFile] = {}
        for path in files:
            file = SafetensorsFile(path)
            for name in file.entries:
                self.location[name] = file

    def shape(self, name: str) -> tuple[int, ...]:
        return self.location[name].entries[name][1]

    def dtype(self, name: str) -> np.dtype:
        return self.location[name].entries[name][0]

    def read_into(self, name: str, out: np.ndarray, rows: range | None = None) -> None:
        self.location[name].read_into(name, out, rows)

    def map_stack(self, names: list[str]) -> np.ndarray | None:
        """The tensors `names` laid end to end in one buffer that maps their file
        pages (copy-on-write, nothing read now), or None when they cannot be mapped:
        each must start on a page boundary of its file, and all but the last fill
        whole pages."""
        pieces = []
        for i, name in enumerate(names):
            offset, nbytes = self.location[name].file_range(name)
            if offset % mmap.PAGESIZE or (i < len(names) - 1 and nbytes % mmap.PAGESIZE):
                return None
            pieces.append((self.location[name].handle.fileno(), offset, nbytes))
        return map_file_pieces(pieces)

    def read_part_into(self, name: str, part: list[range], out: np.ndarray) -> None:
        """Fills `out` with `tensor[part]` (one step-1 range per axis), reading only
        the rows of the first axis that the part covers. A part that takes some
        columns of each row reads whole rows a chunk at a time (at most
        `PART_CHUNK_BYTES` held), never the whole tensor at once."""
        shape = self.shape(name)
        if not shape:
            return self.read_into(name, out)
        if all(len(r) == size for r, size in zip(part[1:], shape[1:])):
            return self.read_into(name, out, part[0])
        row_bytes = math.prod(shape[1:]) * self.dtype(name).itemsize
        step = max(1, PART_CHUNK_BYTES // row_bytes)
        columns = tuple(slice(r.start, r.stop) for r in part[1:])
        for first in range(0, len(part[0]), step):
            rows = part[0][first : first + step]
            chunk = np.empty((len(rows), *shape[1:]), out.dtype)
            self.read_into(name, chunk, rows)
            out[first : first + len(rows)] = chunk[(slice(None), *columns)]


_PROT_READ_WRITE = mmap.PROT_READ | mmap.PROT_WRITE
try:
    _libc = ctypes.CDLL(None, use_errno=True)
    _libc.mmap.restype = ctypes.c_void_p
    _libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64]
    _MAP_FIXED = 0x10  # the same on Linux and macOS; Python's mmap module does not export it
except (OSError, AttributeError, TypeError):  # no C library to call (Windows)
    _libc = None


# The kernel maps a file's 2 MiB page-cache folios with one page-table entry each
# (fewer TLB misses when decode streams the weights) where the virtual address and
# the file offset agree modulo this.
_HUGE_PAGE = 2 << 20


def map_file_pieces(pieces: list[tuple[int, int, int]]) -> np.ndarray | None:
    """A uint8 buffer of the file byte ranges `(fd, page-aligned offset, bytes)`
    laid end to end, made by mapping each range's pages at its place in one
    reserved region; None where the platform cannot.

    The region is placed so that addresses and file offsets agree modulo 2 MiB
    (huge-page mappable while the pieces' sizes are multiples of that). The
    mappings are private (writing to the buffer copies the page, never touches the
    file) and live as long as the returned array: the region is a Python `mmap`,
    unmapped as a whole when the last view of it goes.
    """
    total = sum(nbytes for _, _, nbytes in pieces)
    if _libc is None or total == 0 or not hasattr(mmap, "MAP_PRIVATE"):
        return None
    region = mmap.mmap(-1, total + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, prot=_PROT_READ_WRITE)
    reserved = np.frombuffer(region, np.uint8)
    start = (pieces[0][1] - reserved.ctypes.data) % _HUGE_PAGE
    base, position = reserved.ctypes.data + start, 0
    for fd, offset, nbytes in pieces:
        address = _libc.mmap(base + position, nbytes, _PROT_READ_WRITE, mmap.MAP_PRIVATE | _MAP_FIXED, fd, offset)
        if address != base + position:  # MAP_FAILED: leave the whole region to be unmapped
            return None
        position += nbytes
    return reserved[start : start + total]


def write_safetensors(path: Path, tensors: list[tuple[str, np.ndarray]], metadata: dict[str, str]) -> None:
    """Writes a safetensors file in which every tensor that fills whole pages
    starts on a page boundary, so `TensorSource.map_stack` can map it.

    The header is padded with spaces to a page boundary and the page-sized tensors
    come first, the rest after them (the format allows any order and no gaps).
    The file is written beside `path` and renamed over it once complete and
    synced: a process that mapped the old file keeps reading the old bytes, and a
    failed write leaves the old file (and no partial one).
    """
    dtype_names = {np.dtype(v): k for k, v in SAFETENSORS_DTYPES.items()}
    ordered = sorted(tensors, key=lambda item: item[1].nbytes % mmap.PAGESIZE != 0)  # stable: keeps the order
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name, array in ordered:
        if array.dtype not in dtype_names:
            raise ValueError(f"tensor {name} has dtype {array.dtype}, which safetensors files cannot hold")
        header[name] = {
            "dtype": dtype_names[array.dtype],
            "shape": list(array.shape),
            "data_offsets": [offset, offset + array.nbytes],
        }
        offset += array.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-(8 + len(encoded)) % mmap.PAGESIZE)
    partial = path.with_name(path.name + ".partial")
    try:
        with open(partial, "wb") as f:
            f.write(struct.pack("<Q", len(encoded)) + encoded)
            for _, array in ordered:
                f.write(memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8)))
            f.flush()
            os.fsync(f.fileno())  # on disk before the name points at it
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, path)


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype, alignment: int = 64) -> np.ndarray:
    """An uninitialised array whose data starts on an `alignment`-byte boundary.

    JAX's CPU backend adopts such a buffer without copying it (`from_dlpack`).
    """
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + alignment, np.uint8)
    offset = (-raw.ctypes.data) % alignment
    return raw[offset : offset + nbytes].view(dtype).reshape(shape)
