"""GGUF files for the tests, made with llama.cpp's own tools.

The converter (`convert_hf_to_gguf.py` with its `conversion/` and `gguf-py/`)
comes from the llama-cpp-python source package, which vendors llama.cpp: it is
fetched from PyPI once into a cache folder (or taken from `EQX_MODELS_LLAMA_CPP`,
a llama.cpp tree). Only the Python converter runs; nothing is compiled. Types the
converter does not write (Q4_0, K-quants) are made by re-writing its F32 files
with the `gguf` package's quantizers, which are llama.cpp's reference ones.
"""

import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import gguf
import numpy as np

LLAMA_CPP_PYTHON = "0.3.36"  # vendors llama.cpp 0c1e570, gguf-py 0.19.0
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "eqx_models"
CONVERTER_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")


def llama_cpp_tree() -> Path:
    """A folder holding llama.cpp's converter, fetched on first use."""
    if os.environ.get("EQX_MODELS_LLAMA_CPP"):
        tree = Path(os.environ["EQX_MODELS_LLAMA_CPP"])
        if not (tree / "convert_hf_to_gguf.py").exists():
            raise FileNotFoundError(f"EQX_MODELS_LLAMA_CPP={tree} holds no convert_hf_to_gguf.py.")
        return tree
    tree = CACHE / f"llama.cpp-{LLAMA_CPP_PYTHON}"
    if (tree / "convert_hf_to_gguf.py").exists():
        return tree
    with tempfile.TemporaryDirectory() as download:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
             f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", download],
            check=True,
        )
        (archive,) = Path(download).glob("*.tar.gz")
        root = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp/"
        staging = tree.with_name(tree.name + ".partial")
        with tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers()
                       if m.name.startswith(root) and m.name[len(root):].startswith(CONVERTER_PARTS)]
            for member in members:
                member.name = member.name[len(root):]
            tar.extractall(staging, members=members, filter="data")
        staging.rename(tree)
    return tree


def convert(checkpoint: Path, out: Path, outtype: str = "f32", *options: str) -> Path:
    """`convert_hf_to_gguf.py checkpoint --outtype outtype --outfile out *options`."""
    script = llama_cpp_tree() / "convert_hf_to_gguf.py"
    result = subprocess.run(
        [sys.executable, str(script), str(checkpoint), "--outtype", outtype, "--outfile", str(out), *options],
        capture_output=True, text=True,
    )
    if result.returncode:
        raise RuntimeError(f"convert_hf_to_gguf.py failed:\n{result.stderr[-3000:]}")
    return out


def rewrite(source: Path, out: Path, data_for) -> Path:
    """A copy of the GGUF `source` whose tensors `data_for(name, float_array)`
    may replace: it returns None (keep), False (leave out) or
    `(bytes_or_floats, GGMLQuantizationType)`."""
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(out, reader.get_field("general.architecture").contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), kind, sub_type=sub)
    for tensor in reader.tensors:
        floats = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(
            tuple(reversed(tensor.shape.tolist())))
        replacement = data_for(tensor.name, floats)
        if replacement is False:
            continue
        if replacement is None:
            writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=tensor.tensor_type)
        else:
            data, kind = replacement
            writer.add_tensor(tensor.name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def quantized(floats: np.ndarray, kind) -> tuple[np.ndarray, object]:
    """`floats` in llama.cpp's reference quantization of `kind` (blocks as bytes)."""
    return gguf.quants.quantize(np.ascontiguousarray(floats, np.float32), kind), kind


def random_k_blocks(shape: tuple[int, int], kind, seed: int) -> tuple[np.ndarray, object]:
    """Valid Q4_K or Q6_K blocks of random integers (gguf-py has no K-quantizer):
    every byte random but the float16 super-block scales, set to a small range."""
    block, size = gguf.GGML_QUANT_SIZES[kind]
    rows, width = shape
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, width // block, size), dtype=np.uint8)
    halves = lambda low, high, n: rng.uniform(low, high, (rows, width // block, n)).astype(np.float16).view(np.uint8)
    if kind == gguf.GGMLQuantizationType.Q4_K:
        raw[..., :4] = halves(5e-5, 1e-4, 2)  # d and dmin lead the block
    else:
        raw[..., -2:] = halves(5e-5, 1e-4, 1)  # Q6_K: d ends it
    return raw.reshape(rows, -1), kind


def dequantized_file(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a GGUF file as float32, by the `gguf` package's reference
    dequantization, in numpy shape."""
    reader = gguf.GGUFReader(path)
    return {t.name: gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(
        tuple(reversed(t.shape.tolist()))) for t in reader.tensors}


def tensor_types(path: Path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
