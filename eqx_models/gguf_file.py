"""llama.cpp's GGUF files in: the config, the weights and the tokenizer of one file.

The file is memory-mapped and its header parsed here; the `gguf` package (llama.cpp's
Python library) supplies the tensor types and the dequantization. Q8_0, Q4_0 and Q4_1 matrices
keep their integers and float16 scales (`QuantizedWeight` holds the same blocks, split
into an integer array and a scale array, plus Q4_1's offsets as affine biases); F32, F16 and BF16 tensors are taken as
they are; every other type the `gguf` package can dequantize (the K-quants among
them) is dequantized to the model's float dtype.

GGUF stores tensors with their dimensions reversed (`ne[0]` is the innermost), so a
`[out, in]` weight's bytes are laid out as the Hugging Face tensor's. The llama
architecture's converter interleaves the rotary halves of the query and key rows
(llama.cpp rotates adjacent pairs); loading undoes that, so the model computes
with Hugging Face's split-half rotation.
"""

import math
import mmap
import os
import re
import struct
from pathlib import Path
from typing import Any, NamedTuple

import equinox as eqx
import jax
import ml_dtypes
import numpy as np

from .checkpoint import checkpoint_name, to_jax
from .config import (
    POSITIVE_INTEGER,
    POSITIVE_NUMBER,
    ConfigError,
    check_layer_count,
    is_positive_integer,
    is_positive_number,
)
from .device_memory import gib, refuse_unless_fits
from .nn.rope import inverse_frequencies
from .safetensors_file import CheckpointError, aligned_empty

# GGUF `general.architecture` -> Hugging Face `model_type`.
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe"}
# Our module paths (inside a layer, or at the top) -> GGUF tensor base names.
LAYER_TENSORS = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "mlp.experts.gate_proj": "ffn_gate_exps",
    "mlp.experts.up_proj": "ffn_up_exps",
    "mlp.experts.down_proj": "ffn_down_exps",
}
GLOBAL_TENSORS = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
LAYER_PREFIX = "model.layers."
# Llama 3.x's rope scaling other than `factor`, the values every release uses; the
# file holds only the per-frequency divisors they produce, checked against these.
LLAMA3_ROPE = dict(low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)


def _gguf():
    try:
        import gguf
    except ImportError as e:
        raise ImportError(
            "Reading GGUF files needs the `gguf` package (llama.cpp's reader): pip install gguf "
            "(or pip install 'eqx_models[gguf]')."
        ) from e
    return gguf


def find_gguf(name_or_path: str | os.PathLike) -> Path | None:
    """The GGUF file `name_or_path` names: a `.gguf` file, or a folder without
    `config.json` that holds exactly one (or the parts of one split file: the
    first). None when it names neither.

    Raises:
        FileNotFoundError: a folder with several GGUF files (which one is ambiguous).
    """
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path if path.suffix == ".gguf" else None
    if not path.is_dir() or (path / "config.json").exists():
        return None
    files = sorted(path.glob("*.gguf"))
    if len(files) > 1 and split_parts(files[0]) == files:  # the parts of one split file
        return files[0]
    if len(files) > 1:
        raise FileNotFoundError(
            f"{path} holds several GGUF files ({', '.join(f.name for f in files)}); pass the one to load."
        )
    return files[0] if files else None


class GGUFTensor(NamedTuple):
    """One tensor's entry: its type, numpy-order shape and stored bytes (mapped)."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    n_elements: int
    data: np.ndarray


# GGUF metadata value types (the file format's numbering) -> struct formats.
SCALAR_TYPES = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9
GGUF_MAGIC = b"GGUF"
# The fewest bytes a string, a key-value pair (key length, value type, a one-byte
# value) and a tensor's entry (name length, dimension count, one dimension, type,
# offset) take: what a count in the header is checked against.
STRING_LENGTH_BYTES = 8
LEAST_KV_BYTES = 8 + 4 + 1
LEAST_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
INTEGER_TYPES = ("I8", "I16", "I32", "I64")


class _Header:
    """A little-endian GGUF header read from the front of a mapped file. (The `gguf`
    package's own reader builds numpy arrays for every string of a vocabulary:
    18 s and 700 MB for Qwen's 151,936 tokens and 294,166 merges.)"""

    def __init__(self, buffer: np.ndarray):
        self.buffer, self.offset = memoryview(buffer), 0

    def take(self, size: int) -> memoryview:
        if self.offset + size > len(self.buffer):
            raise ValueError(f"the header runs past the end of the file at byte {self.offset + size:,}")
        piece = self.buffer[self.offset : self.offset + size]
        self.offset += size
        return piece

    def scalar(self, kind: int):
        form = "<" + SCALAR_TYPES[kind]
        return struct.unpack(form, self.take(struct.calcsize(form)))[0]

    def string(self) -> str:
        return str(self.take(self.scalar(10)), "utf-8", errors="replace")

    def value(self, kind: int, key: str):
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            inner, count = self.scalar(4), self.scalar(10)
            if inner != STRING and inner not in SCALAR_TYPES:
                raise ValueError(f"{key} is an array of unknown element type {inner}")
            self.fits(count, STRING_LENGTH_BYTES if inner == STRING else struct.calcsize(SCALAR_TYPES[inner]), key)
            if inner == STRING:
                return [self.string() for _ in range(count)]
            form = f"<{count}{SCALAR_TYPES[inner]}"
            return list(struct.unpack(form, self.take(struct.calcsize(form))))
        if kind not in SCALAR_TYPES:
            raise ValueError(f"{key} has unknown metadata value type {kind}")
        return self.scalar(kind)

    def fits(self, count: int, least_bytes: int, what: str) -> None:
        """Refuses a count of items of at least `least_bytes` each that the rest of
        the file cannot hold, before anything is built for them."""
        left = len(self.buffer) - self.offset
        if count * least_bytes > left:
            raise ValueError(
                f"{what} claims {count:,} entries of at least {least_bytes} bytes each, but only {left:,} bytes "
                "of the file are left"
            )


def _tensor_info(header: _Header, gguf) -> tuple[str, list[int], Any, int]:
    """One tensor's entry of the header: its name, dimensions (innermost first),
    GGML type and data offset, checked for form."""
    name = header.string()
    n_dims = header.scalar(4)
    if not 1 <= n_dims <= MAX_DIMS:
        raise ValueError(f"tensor {name} has {n_dims:,} dimensions; GGUF tensors have 1 to {MAX_DIMS}")
    dims = [header.scalar(10) for _ in range(n_dims)]
    type_number = header.scalar(4)
    try:
        kind = gguf.GGMLQuantizationType(type_number)
    except ValueError:
        raise ValueError(f"tensor {name} has type number {type_number}, which is no GGML type") from None
    if kind not in gguf.GGML_QUANT_SIZES:
        raise ValueError(f"tensor {name} has type {kind.name}, whose block size the gguf package does not know")
    return name, dims, kind, header.scalar(10)


def _check_offset(name: str, offset: int, expected: int, previous: str | None, alignment: int) -> None:
    """Refuses a tensor that does not start where the tensor before it (`previous`)
    ends: as llama.cpp requires, tensors lie in the order of the header, each
    padded to the file's alignment, so none overlaps or repeats another's bytes."""
    if offset % alignment:
        raise ValueError(f"tensor {name} starts at data offset {offset:,}, not a multiple of the file's "
                         f"alignment of {alignment}")
    if offset != expected:
        before = "the data section starts" if previous is None else f"tensor {previous} before it ends"
        what = "they overlap" if offset < expected else f"a gap after tensor {previous}"
        raise ValueError(
            f"tensor {name} starts at data offset {offset:,}, but {before} at {expected:,} (padded to the "
            f"alignment): {what}; one of their types or offsets was changed"
        )


# llama.cpp's split files (`llama-gguf-split`, `convert_hf_to_gguf.py --split-max-*`): the
# metadata in the first, the tensors spread over all, named <prefix>-00001-of-00003.gguf.
SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<number>\d{5})-of-(?P<count>\d{5})\.gguf$")


def split_parts(path: Path) -> list[Path] | None:
    """Every part of the split GGUF file `path` belongs to (by its name), in order;
    None for a name that is not a part's."""
    match = SPLIT_NAME.match(path.name)
    if match is None:
        return None
    count = int(match["count"])
    return [path.with_name(f"{match['prefix']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


class GGUFFile:
    """One GGUF file, memory-mapped: its metadata and tensors. The first part of a
    split file (`...-00001-of-0000N.gguf`) brings in the other parts beside it.

    Args:
        path: the `.gguf` file.

    Raises:
        CheckpointError: not a GGUF file, a big-endian one, or one that is
            truncated or corrupt; counts the file cannot hold (checked before
            anything is built for them), a key or tensor listed twice, a tensor
            whose rows are not whole blocks of its type, or one that does not
            start where the tensors before it end (padded to the alignment, as
            llama.cpp requires: so no overlap, gap or misalignment); a split
            file's later part, or one whose parts are missing or disagree.
    """

    def __init__(self, path: str | os.PathLike):
        gguf = _gguf()
        self.path = Path(path)
        self._maps: list[tuple[mmap.mmap, np.ndarray]] = []
        self.metadata, self.tensors = self._open(self.path, gguf)
        count, number = self.metadata.get("split.count", 1), self.metadata.get("split.no", 0)
        if count > 1:
            self._join_parts(gguf, count, number)
        self.architecture = self.value("general.architecture")

    def _open(self, path: Path, gguf) -> tuple[dict, dict]:
        try:
            with open(path, "rb") as handle:
                mapping = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
            mapped = np.frombuffer(mapping, np.uint8)
            self._maps.append((mapping, mapped))
            return self._read(mapped, gguf)
        except (ValueError, IndexError, KeyError, OverflowError, struct.error) as e:
            size = path.stat().st_size
            raise CheckpointError(
                f"{path} ({size:,} bytes) is not a readable GGUF file: {e}. It may be truncated or corrupt "
                "(an interrupted download): fetch or convert it again."
            ) from e

    def _join_parts(self, gguf, count: int, number: int) -> None:
        parts = split_parts(self.path)
        if parts is None or len(parts) != count:
            raise CheckpointError(
                f"{self.path} is part {number + 1} of a GGUF split in {count} files, but its name does not follow "
                "llama.cpp's <name>-00001-of-0000N.gguf pattern, so its other parts cannot be found: keep the "
                "names llama-gguf-split gave them."
            )
        if number != 0:
            raise CheckpointError(
                f"{self.path} is part {number + 1} of {count} of a split GGUF file; pass the first part, {parts[0]}."
            )
        missing = [part.name for part in parts[1:] if not part.exists()]
        if missing:
            raise CheckpointError(
                f"{self.path} is the first of {count} parts of a split GGUF file, and {', '.join(missing)} "
                f"{'is' if len(missing) == 1 else 'are'} not beside it: download or copy every part."
            )
        for index, part in enumerate(parts[1:], 1):
            metadata, tensors = self._open(part, gguf)
            if (metadata.get("split.no"), metadata.get("split.count")) != (index, count):
                raise CheckpointError(
                    f"{part} says it is part {metadata.get('split.no', 0) + 1} of {metadata.get('split.count', 1)}, "
                    f"not part {index + 1} of {count} as its name does: the parts come from different splits."
                )
            twice = sorted(tensors.keys() & self.tensors.keys())
            if twice:
                raise CheckpointError(f"{part} repeats tensors of an earlier part: {twice[:5]}.")
            self.tensors.update(tensors)
        expected = self.metadata.get("split.tensors.count")
        if expected is not None and expected != len(self.tensors):
            raise CheckpointError(
                f"{self.path}: the {count} parts hold {len(self.tensors)} tensors, but the first says "
                f"{expected}: a part is from another split."
            )

    def _read(self, mapped: np.ndarray, gguf) -> tuple[dict, dict]:
        header = _Header(mapped)
        if bytes(header.take(4)) != GGUF_MAGIC:
            raise ValueError("it does not start with the GGUF magic")
        version = header.scalar(4)
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (big-endian, or unknown); versions 2 and 3 are read")
        tensor_count, kv_count = header.scalar(10), header.scalar(10)
        header.fits(kv_count, LEAST_KV_BYTES, "the metadata count")
        metadata = {}
        for _ in range(kv_count):
            key = header.string()
            if key in metadata:
                raise ValueError(f"the metadata key {key} appears twice")
            metadata[key] = header.value(header.scalar(4), key)
        header.fits(tensor_count, LEAST_TENSOR_INFO_BYTES, "the tensor count")
        infos = {}
        for _ in range(tensor_count):
            name, dims, kind, offset = _tensor_info(header, gguf)
            if name in infos:
                raise ValueError(f"tensor {name} is listed twice")
            infos[name] = (dims, kind, offset)
        alignment = metadata.get("general.alignment", 32)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment {alignment!r} is not a power of two")
        start = -(-header.offset // alignment) * alignment
        tensors = {}
        position, previous = 0, None  # where the next tensor starts: each follows the one before, padded
        for name, (dims, kind, offset) in infos.items():
            block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
            shape = tuple(int(d) for d in reversed(dims))
            if shape[-1] % block:
                raise ValueError(
                    f"tensor {name} of type {kind.name} has rows of {shape[-1]} elements, not a multiple of the "
                    f"type's block of {block} (its type was changed, or the file is corrupt)"
                )
            count = math.prod(shape)
            nbytes = count // block * block_bytes
            _check_offset(name, offset, position, previous, alignment)
            begin = start + offset
            if begin + nbytes > len(mapped):
                raise ValueError(f"tensor {name} ({nbytes:,} bytes at {begin:,}) runs past the end of the file")
            position, previous = offset + -(-nbytes // alignment) * alignment, name
            raw = mapped[begin : begin + nbytes]
            if kind.name in ("F32", "F16"):
                data = raw.view(np.float32 if kind.name == "F32" else np.float16).reshape(shape)
            else:
                data = raw.reshape(*shape[:-1], shape[-1] // block * block_bytes)
            tensors[name] = GGUFTensor(name, kind, shape, count, data)
        if len(mapped) > start + position:
            raise ValueError(
                f"{len(mapped) - start - position:,} bytes follow the last tensor's data (a tensor's type or "
                "size was changed, or something was appended)"
            )
        return metadata, tensors

    def release(self, names: list[str]) -> None:
        """Drops the file's pages behind these tensors from the process (after they
        are copied), so loading holds the model and one leaf of the file, not the
        whole file beside the model."""
        for name in names:
            data = self.tensors[name].data
            for mapping, mapped in self._maps:  # the part holding it
                begin = data.ctypes.data - mapped.ctypes.data
                if 0 <= begin < len(mapped):
                    first = -(-begin // mmap.PAGESIZE) * mmap.PAGESIZE
                    last = (begin + data.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
                    if last > first:
                        mapping.madvise(mmap.MADV_DONTNEED, first, last - first)
                    break

    def value(self, key: str, default: Any = None) -> Any:
        """The metadata value under `key` (strings decoded, arrays as lists)."""
        return self.metadata.get(key, default)

    def arch_value(self, key: str, default: Any = None) -> Any:
        """The value of `<architecture>.<key>`."""
        return self.value(f"{self.architecture}.{key}", default)

    def type_name(self, name: str) -> str:
        return self.tensors[name].tensor_type.name

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape in numpy order (`[out, in]` for a weight)."""
        return self.tensors[name].shape

    def float_array(self, name: str) -> np.ndarray:
        """A tensor as a float array of its shape: F32, F16 and BF16 as stored,
        quantized types dequantized to float32 by the `gguf` package."""
        gguf = _gguf()
        tensor = self.tensors[name]
        kind = tensor.tensor_type
        types = gguf.GGMLQuantizationType
        if kind in (types.F32, types.F16):
            return tensor.data.reshape(self.shape(name))
        if kind == types.BF16:
            return tensor.data.view(np.uint16).view(ml_dtypes.bfloat16).reshape(self.shape(name))
        if kind.name in INTEGER_TYPES:
            raise CheckpointError(
                f"{self.path}: tensor {name} is of integer type {kind.name}; a model's weights are float or "
                "quantized types (F32, F16, BF16, Q8_0, ...). The file is corrupt or its types were changed."
            )
        try:
            return gguf.quants.dequantize(tensor.data, kind).reshape(self.shape(name))
        except NotImplementedError as e:
            raise CheckpointError(
                f"{self.path}: tensor {name} is of type {kind.name}, which the gguf package cannot dequantize. "
                "Re-quantize the model with llama-quantize to Q8_0, Q4_0 or a K-quant (Q4_K_M, Q6_K, ...)."
            ) from e

    def blocks(self, name: str) -> tuple[int, np.ndarray, np.ndarray, np.ndarray | None]:
        """A Q8_0, Q4_0 or Q4_1 tensor split into `(bits, integers, scales, biases)`:
        the bytes of each block after its float16 header, and the header's scales
        and (Q4_1's `m`, else None) biases, `[..., rows, groups]`."""
        kind = self.type_name(name)
        bits = {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4}[kind]
        header = 4 if kind == "Q4_1" else 2  # Q4_1: d then m, w = d * q + m
        *rows, width = self.shape(name)  # rows: `[out]`, or `[experts, out]` for a layer's experts
        per_block = 32 * bits // 8
        raw = self.tensors[name].data.reshape(*rows, width // 32, header + per_block)
        halves = np.ascontiguousarray(raw[..., :header]).view(np.float16)
        integers = raw[..., header:].reshape(*rows, width * bits // 8)
        biases = halves[..., 1] if kind == "Q4_1" else None
        return bits, integers.view(np.int8) if bits == 8 else integers, halves[..., 0], biases


def hf_config(file: GGUFFile) -> dict[str, Any]:
    """The Hugging Face `config.json` the file's metadata describes.

    Raises:
        ConfigError: an architecture not in `ARCHITECTURES`, or settings (partial
            rotary, rope scaling kinds, per-layer head counts) with no HF equivalent here.
    """
    arch = file.architecture
    if arch not in ARCHITECTURES:
        raise ConfigError(
            f"{file.path} holds a {arch!r} model; GGUF loading reads {sorted(ARCHITECTURES)}. Load the original "
            "Hugging Face checkpoint instead (from_pretrained(repo or folder)), which covers more families."
        )

    def need(key, default=None, integer=True):
        return _metadata_number(file, key, default, integer=integer)

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = int(need("attention.key_length", hidden // heads))
    if int(need("attention.value_length", head_dim)) != head_dim:
        raise ConfigError(f"{file.path}: keys and values of different widths are not supported.")
    if int(need("rope.dimension_count", head_dim)) != head_dim:
        raise ConfigError(f"{file.path}: rotary embedding on part of each head is not supported for {arch!r}.")
    if "token_embd.weight" not in file.tensors:
        raise ConfigError(f"{file.path} has no token_embd.weight: it holds no whole {arch} model.")
    vocab = file.shape("token_embd.weight")[0]
    hf = dict(
        model_type=ARCHITECTURES[arch],
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=int(need("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(need("attention.head_count_kv", heads)),
        head_dim=head_dim,
        max_position_embeddings=int(need("context_length")),
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon", integer=False)),
        rope_theta=float(need("rope.freq_base", 10000.0, integer=False)),
        rope_scaling=_rope_scaling(file, head_dim),
        tie_word_embeddings="output.weight" not in file.tensors,
        bos_token_id=file.value("tokenizer.ggml.bos_token_id"),
        eos_token_id=file.value("tokenizer.ggml.eos_token_id"),
        hidden_act="silu",
    )
    if arch == "llama":
        hf.update(attention_bias="blk.0.attn_q.bias" in file.tensors, mlp_bias=False)
    if arch == "qwen3moe":
        hf.update(
            num_experts=int(need("expert_count")),
            num_experts_per_tok=int(need("expert_used_count")),
            moe_intermediate_size=int(need("expert_feed_forward_length")),
            # llama.cpp renormalises the top-k weights of every qwen3moe model.
            norm_topk_prob=True,
        )
        hf["intermediate_size"] = int(need("feed_forward_length", hf["moe_intermediate_size"]))
    else:
        hf["intermediate_size"] = int(need("feed_forward_length"))
    return hf


def _metadata_number(file: GGUFFile, key: str, default: Any = None, *, integer: bool = True,
                     required: bool = True) -> int | float | None:
    """The value of `<architecture>.<key>`, refused unless it is one integer >= 1
    (or with `integer=False` one finite number > 0), by the rules config.json's
    fields follow; None where it is absent and not `required`.

    Raises:
        ConfigError: naming the key, its value and what it must be.
    """
    name = f"{file.architecture}.{key}"
    value = file.arch_value(key, default)
    if value is None:
        if not required:
            return None
        raise ConfigError(f"{file.path} has no {name} in its metadata; the file is incomplete.")
    if isinstance(value, list):
        raise ConfigError(f"{file.path}: {name} varies by layer ({value[:4]}...), which is not supported.")
    allowed, ok = (POSITIVE_INTEGER, is_positive_integer) if integer else (POSITIVE_NUMBER, is_positive_number)
    if not ok(value):
        raise ConfigError(f"{file.path}: {name} is {value!r}; it must be {allowed}. The file is corrupt or was edited.")
    return value


def _rope_scaling(file: GGUFFile, head_dim: int) -> dict | None:
    if "rope_freqs.weight" in file.tensors:
        return _llama3_scaling(file, head_dim)
    kind = file.arch_value("rope.scaling.type", "none")
    if kind == "none":
        return None
    factor = _scaling_factor(file)
    if kind == "linear":
        return None if factor in (None, 1.0) else dict(rope_type="linear", factor=float(factor))
    if kind == "yarn":
        if factor is None:
            raise ConfigError(
                f"{file.path}: yarn rope scaling without {file.architecture}.rope.scaling.factor (absent or 0.0)."
            )
        original = _metadata_number(file, "rope.scaling.original_context_length", required=False)
        if original is None:
            raise ConfigError(f"{file.path}: yarn rope scaling without rope.scaling.original_context_length.")
        return dict(rope_type="yarn", factor=float(factor), original_max_position_embeddings=int(original))
    raise ConfigError(f"{file.path}: rope scaling {kind!r} is not supported (none, linear, yarn and Llama 3's are).")


def _scaling_factor(file: GGUFFile) -> float | None:
    """`rope.scaling.factor` for the scaling types that read it, None where it is
    absent or 0.0, which llama.cpp reads as "no scaling" (converters write it so)."""
    value = file.arch_value("rope.scaling.factor")
    if value is None or (not isinstance(value, bool) and value == 0.0):
        return None
    return _metadata_number(file, "rope.scaling.factor", integer=False)


def _llama3_scaling(file: GGUFFile, head_dim: int) -> dict:
    """Llama 3's rope scaling from the per-frequency divisors the file holds."""
    divisors = file.float_array("rope_freqs.weight").astype(np.float32)
    theta = float(_metadata_number(file, "rope.freq_base", 10000.0, integer=False))
    plain = inverse_frequencies(head_dim, theta, None)
    candidates = [LLAMA3_ROPE["original_max_position_embeddings"]]
    original = _metadata_number(file, "rope.scaling.original_context_length", required=False)
    if original is not None:
        candidates.insert(0, int(original))
    for original in candidates:
        scaling = dict(LLAMA3_ROPE, rope_type="llama3", factor=float(divisors.max()),
                       original_max_position_embeddings=int(original))
        ours = inverse_frequencies(head_dim, theta, tuple(scaling.items()))
        if divisors.shape == ours.shape and np.allclose(plain / divisors, ours, rtol=1e-5):
            return scaling
    raise ConfigError(
        f"{file.path} carries rope_freqs that Llama 3's scaling with {LLAMA3_ROPE} does not reproduce; "
        "load the Hugging Face checkpoint, whose config states the scaling."
    )


def gguf_names(ours: str, stacked: tuple[int, ...]) -> list[str] | None:
    """The GGUF tensors of one of our leaves (one per layer for the layer stack),
    or None when the file format has no name for it."""
    module, param = ours.rsplit(".", 1)
    if module.startswith(LAYER_PREFIX):
        base = LAYER_TENSORS.get(module[len(LAYER_PREFIX):])
        return None if base is None else [f"blk.{i}.{base}.{param}" for i in range(stacked[0])]
    base = GLOBAL_TENSORS.get(module)
    return None if base is None else [f"{base}.{param}"]


def _interleaved_heads(file: GGUFFile, name: str) -> int | None:
    """For the llama architecture's query and key tensors, the head count their
    rows were interleaved by; None for every other tensor."""
    if file.architecture != "llama":
        return None
    if ".attn_q." in name:
        return int(file.arch_value("attention.head_count"))
    if ".attn_k." in name:
        return int(file.arch_value("attention.head_count_kv", file.arch_value("attention.head_count")))
    return None


def _split_halves(rows: np.ndarray, heads: int | None) -> np.ndarray:
    """Rows back in Hugging Face's order: within each head, the first of every
    rotated pair, then the second."""
    if heads is None:
        return rows
    return rows.reshape(heads, rows.shape[0] // heads // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


PACKED_TYPES = ("Q8_0", "Q4_0", "Q4_1")  # Q4_1: affine int4 in groups of 32
KEPT_FLOAT = ("F32", "F16")


def default_dtype(file: GGUFFile) -> np.dtype:
    """float32, unless most matrix weights are BF16 or dequantized (K-quants and
    the rest, and expert stacks of any quantized type): then bfloat16."""
    weights = [t for t in file.tensors.values() if len(t.shape) > 1]
    kept = lambda t: t.tensor_type.name in KEPT_FLOAT or (t.tensor_type.name in PACKED_TYPES and len(t.shape) == 2)
    compact = sum(int(t.n_elements) for t in weights if not kept(t))  # expert stacks are never kept packed
    return np.dtype(ml_dtypes.bfloat16 if 2 * compact > sum(int(t.n_elements) for t in weights) else np.float32)


def load_leaves(file: GGUFFile, skeleton, packable: dict[tuple, Any], dtype: np.dtype) -> tuple[list, dict]:
    """Every leaf of `skeleton` read from the file.

    Returns the arrays in leaf order, and for the weights in `packable` whose every
    tensor is Q8_0 (or every one Q4_0, or Q4_1) `{path: (bits, integers, scales,
    biases)}`; those
    leaves' entries in the first list are None. Tensors the file has and the model
    does not use, or the other way round, raise `CheckpointError` (all listed).
    """
    leaves = jax.tree_util.tree_flatten_with_path(skeleton)[0]
    problems, consumed, plan = [], set(), []
    for path, leaf in leaves:
        ours = checkpoint_name(path)
        names = gguf_names(ours, leaf.shape)
        stacked = leaf.shape[:1] if len(names or ()) > 1 or ours.startswith(LAYER_PREFIX) else ()
        expected = leaf.shape[len(stacked):]
        for name in names or [f"(no GGUF name for {ours})"]:
            if name not in file.tensors:
                problems.append(f"missing tensor {name} (expected shape {tuple(expected)})")
            elif file.shape(name) != tuple(expected):
                problems.append(f"tensor {name} has shape {file.shape(name)}, expected {tuple(expected)}")
        consumed.update(names or ())
        plan.append((path, names, stacked))
    derived = {"rope_freqs.weight"}
    problems += [f"unexpected tensor {n} {file.shape(n)}" for n in sorted(set(file.tensors) - consumed - derived)]
    if problems:
        listing = "\n  ".join(problems[:40]) + (f"\n  ... and {len(problems) - 40} more" if len(problems) > 40 else "")
        raise CheckpointError(f"{file.path} does not hold the {file.architecture} model its metadata describes:\n  "
                              + listing)

    arrays, packed = [], {}
    for path, names, stacked in plan:
        kinds = {file.type_name(n) for n in names}
        if tuple(path) in packable and len(kinds) == 1 and kinds <= set(PACKED_TYPES):
            packed[tuple(path)] = _read_blocks(file, names, stacked)
            arrays.append(None)
        else:
            arrays.append(_read_floats(file, names, stacked, dtype))
        file.release(names)
    return arrays, packed


def _read_floats(file: GGUFFile, names: list[str], stacked: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    out = aligned_empty((*stacked, *file.shape(names[0])), np.dtype(dtype))
    parts = out.reshape(-1, *file.shape(names[0]))
    for i, name in enumerate(names):
        parts[i] = _split_halves(file.float_array(name), _interleaved_heads(file, name))
    return out


def _read_blocks(file: GGUFFile, names: list[str], stacked: tuple[int, ...]):
    integers = scales = biases = None
    for i, name in enumerate(names):
        bits, q, s, b = file.blocks(name)
        if integers is None:
            integers = aligned_empty((*stacked, *q.shape), q.dtype)
            scales = aligned_empty((*stacked, *s.shape), np.dtype(np.float16))
            biases = None if b is None else aligned_empty((*stacked, *s.shape), np.dtype(np.float16))
        heads = _interleaved_heads(file, name)
        integers.reshape(-1, *q.shape)[i] = _split_halves(q, heads)
        scales.reshape(-1, *s.shape)[i] = _split_halves(s, heads)
        if biases is not None:
            biases.reshape(-1, *s.shape)[i] = _split_halves(b, heads)
    return bits, integers, scales, biases


def read_generation_eos(file: GGUFFile) -> tuple[int, ...]:
    """The ids that end generation: the EOS token and an end-of-turn token if the
    file names one."""
    ids = [file.value(f"tokenizer.ggml.{key}") for key in ("eos_token_id", "eot_token_id", "eom_token_id")]
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))



def load_gguf(path: Path, *, dtype=None, scan_layers: bool = True, mesh=None, sharding=None, quantize=None):
    """`from_pretrained` for a GGUF file (see there for the arguments).

    Q8_0, Q4_0 and Q4_1 (affine) weights load packed as `QuantizedWeight`s (int8
    activations, as llama.cpp computes them) wherever `eqx_models.quantize` would quantize; a leaf
    whose layers mix types, and every other tensor, loads as floats in `dtype`
    (default: `default_dtype`).
    """
    from .models import architecture_for
    from .nn.causal_lm import CausalLM
    from .quantization import QuantizedWeight, host_tiles, quantizable_layers, spec_for, tiles_fit, tiles_pay
    from .quantization import quantize as quantize_model
    from .sharding import shard_model

    file = GGUFFile(path)
    arch = architecture_for(hf := hf_config(file))  # checks the fields' types and ranges
    check_layer_count(hf, len(file.tensors), str(file.path))
    config = arch.config_from_hf(hf)
    dtype = default_dtype(file) if dtype is None else np.dtype(dtype)
    skeleton = eqx.filter_eval_shape(CausalLM, config, key=jax.random.key(0), scan_layers=scan_layers)
    packable = {(*path, jax.tree_util.GetAttrKey("weight")): axes for path, _, axes in quantizable_layers(skeleton)}
    arrays, packed = load_leaves(file, skeleton, packable, dtype)
    _refuse_beyond_device_memory(path, arrays, packed, dtype)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(skeleton)
    model = jax.tree_util.tree_unflatten(treedef, [
        jax.numpy.zeros((), leaf.dtype) if array is None else to_jax(array)
        for (_, leaf), array in zip(leaves, arrays)
    ])
    # Q8_0 weights go into the CPU kernel's tiles as they load (see `quantization.with_layout`).
    tiles = mesh is None and bool(packed) and tiles_pay()  # asked only of packed weights: it builds their kernels
    for leaf_path, (bits, integers, scales, biases) in packed.items():
        layout = "tiles" if tiles and tiles_fit(bits, "int8", integers.shape) else "rows"
        if layout == "tiles":
            integers, scales = host_tiles(integers if integers.flags.writeable else integers.copy(), scales)
        weight = QuantizedWeight(to_jax(integers), to_jax(scales), bits, 32, packable[leaf_path], dtype,
                                 biases=None if biases is None else to_jax(biases), layout=layout)
        model = eqx.tree_at(lambda m, leaf_path=leaf_path: _at(m, leaf_path), model, weight)
    if quantize is not None:
        if packed:
            raise ValueError(f"{path} is already quantized ({len(packed)} packed weights); drop quantize=.")
        model = quantize_model(model, **spec_for(quantize).options(), layout="rows" if mesh is not None else "auto")
    if mesh is not None:
        model = shard_model(model, mesh, sharding)
    return model


def _refuse_beyond_device_memory(path: Path, arrays: list, packed: dict, dtype: np.dtype) -> None:
    """Refuses (`OutOfDeviceMemory`) a file whose weights, as read, are more than the
    default device's free memory: they all go there first (then onto a mesh)."""
    needed = sum(a.nbytes for a in arrays if a is not None)
    needed += sum(part.nbytes for parts in packed.values() for part in parts[1:] if part is not None)
    fixes = []
    if not packed:
        fixes.append("a Q8_0 or Q4_0 file of the model (its weights load packed: about a half or a quarter of "
                     "bfloat16's bytes)")
    if dtype == np.float32:
        fixes.append(f"dtype=jnp.bfloat16 (about {gib(needed / 2)})")
    refuse_unless_fits(f"The weights of {path} ({dtype.name})", needed, [jax.devices()[0]], fixes)


def _at(tree, path):
    from .quantized import tree_child

    for key in path:
        tree = tree_child(tree, key)
    return tree
