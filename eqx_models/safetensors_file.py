"""Safetensors files: reading tensors into caller-owned buffers, mapping page-aligned
ones without a copy, and writing files whose tensors are page-aligned.

The format is an 8-byte little-endian header length, a JSON header of
`{name: {dtype, shape, data_offsets}}` (offsets relative to the end of the header),
then the tensors' bytes, back to back with no gaps.
"""

import contextlib
import ctypes
import json
import math
import mmap
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import ml_dtypes
import numpy as np

from .config import is_integer

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
    process's resident memory. The header is checked up front, O(tensors) and
    without reading any tensor data: every entry's form, and that the data ranges
    tile the data section exactly (no overlap, no gap, nothing past the end), so a
    truncated or tampered file is reported, naming the tensor, before anything is
    loaded.

    Raises:
        CheckpointError: an unreadable or malformed header, or data ranges that
            do not tile the file.
    """

    def __init__(self, path: Path):
        self.path = path
        size = path.stat().st_size
        try:
            self.handle = open(path, "rb", buffering=0)
            (header_length,) = struct.unpack("<Q", self.handle.read(8))
            if header_length > size - 8:
                raise ValueError(f"the header claims {header_length} bytes but the file has {size}")
            header = json.loads(self.handle.read(header_length), object_pairs_hook=_unique_keys)
        except (struct.error, ValueError, UnicodeDecodeError) as e:
            raise CheckpointError(
                f"{path} is not a readable safetensors file ({e}); it may be truncated or corrupt. "
                "Delete it and download it again."
            ) from e
        if not isinstance(header, dict):
            raise CheckpointError(
                f"{path}: the header is a JSON {type(header).__name__}, not an object of tensor entries; "
                "the file is corrupt. Delete it and download it again."
            )
        header.pop("__metadata__", None)
        self.data_start = 8 + header_length
        self.entries: dict[str, tuple[np.dtype, tuple[int, ...], int]] = {}
        ranges = []
        for name, info in header.items():
            dtype, shape, (begin, end) = _entry(path, name, info)
            if end - begin != math.prod(shape) * dtype.itemsize:
                raise CheckpointError(
                    f"{path}: tensor {name} has dtype {info['dtype']} and shape {list(shape)}, which take "
                    f"{math.prod(shape) * dtype.itemsize} bytes, but its data_offsets {[begin, end]} span "
                    f"{end - begin}. The file is corrupt (or its header was edited): download it again."
                )
            self.entries[name] = (dtype, shape, begin)
            ranges.append((begin, end, name))
        _check_layout(path, ranges, size - self.data_start)

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


def _entry(path: Path, name: str, info) -> tuple[np.dtype, tuple[int, ...], tuple[int, int]]:
    """The dtype, shape and data offsets of one header entry, each checked for its
    form (an object with a known `dtype`, a list of non-negative integer
    dimensions, and two non-negative integer offsets, the second not before the first)."""
    where = f"{path}: tensor {name}"
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        raise CheckpointError(
            f"{where} has the header entry {info!r}; an entry is an object with dtype, shape and "
            "data_offsets. The file is corrupt: download it again."
        )
    if not isinstance(info["dtype"], str) or info["dtype"] not in SAFETENSORS_DTYPES:
        raise CheckpointError(
            f"{where} has dtype {info['dtype']!r}, which is not supported; expected one of "
            f"{sorted(SAFETENSORS_DTYPES)}."
        )
    shape, offsets = info["shape"], info["data_offsets"]
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise CheckpointError(f"{where} has shape {shape!r}; a shape is a list of non-negative integers.")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)
            and offsets[0] <= offsets[1]):
        raise CheckpointError(
            f"{where} has data_offsets {offsets!r}; they are two non-negative integers [begin, end] "
            "with end >= begin. The file is corrupt: download it again."
        )
    return np.dtype(SAFETENSORS_DTYPES[info["dtype"]]), tuple(shape), (offsets[0], offsets[1])


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object, refusing a key it holds twice (a tensor listed twice: which
    entry is meant is unknowable)."""
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError(f"the header names {key!r} twice")
        seen[key] = value
    return seen


def _is_count(value) -> bool:
    return is_integer(value) and value >= 0


def _check_layout(path: Path, ranges: list[tuple[int, int, str]], data_size: int) -> None:
    """Refuses data ranges that do not tile the data section: as the format (and the
    `safetensors` library) requires, the tensors lie back to back from its first
    byte to the end of the file, so none reaches outside it and no two share bytes."""
    ranges = sorted(ranges)
    for begin, end, name in ranges:
        if end > data_size:
            raise CheckpointError(
                f"{path} is truncated or corrupt: tensor {name} should occupy data bytes {begin}-{end} but the "
                f"file holds {data_size} bytes of data. Delete it and download it again."
            )
    for (_, previous_end, previous), (begin, _, name) in zip(ranges, ranges[1:]):
        if begin < previous_end:
            raise CheckpointError(
                f"{path}: tensor {name} starts at data byte {begin}, inside tensor {previous} (which ends at byte "
                f"{previous_end}): it overlaps the tensor before it. The file is corrupt: download it again."
            )
    position = 0
    for begin, end, name in ranges:
        if begin != position:
            raise CheckpointError(
                f"{path}: tensor {name} starts at data byte {begin}, but the tensors before it end at byte "
                f"{position}: a gap, where tensors lie back to back. The file is corrupt: download it again."
            )
        position = end
    if position != data_size:
        raise CheckpointError(
            f"{path}: its tensors end at data byte {position} but the file holds {data_size} bytes of data; "
            "the file is corrupt (or was appended to). Download it again."
        )


class TensorSource:
    """Where each tensor of a (possibly sharded) checkpoint lives."""

    def __init__(self, files: list[Path]):
        self.location: dict[str, SafetensorsFile] = {}
        for path in files:
            file = SafetensorsFile(path)
            for name in file.entries:
                if name in self.location:
                    raise CheckpointError(
                        f"tensor {name} is in both {self.location[name].path} and {path}; a checkpoint holds "
                        "each tensor once. Remove the stale file (or download the checkpoint again)."
                    )
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
    with replacing(path) as f:
        f.write(struct.pack("<Q", len(encoded)) + encoded)
        for _, array in ordered:
            f.write(memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8)))


@contextlib.contextmanager
def replacing(path: Path) -> Iterator[IO[bytes]]:
    """A binary file to write in place of `path`: written beside it
    (`<name>.partial`), flushed to disk, then renamed over it when the block ends;
    removed if the block fails, so `path` is either the old file or the whole new one."""
    partial = path.with_name(path.name + ".partial")
    try:
        with open(partial, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())  # on disk before the name points at it
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype, alignment: int = 64) -> np.ndarray:
    """An uninitialised array whose data starts on an `alignment`-byte boundary.

    JAX's CPU backend adopts such a buffer without copying it (`from_dlpack`).
    """
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + alignment, np.uint8)
    offset = (-raw.ctypes.data) % alignment
    return raw[offset : offset + nbytes].view(dtype).reshape(shape)
