"""Shared test helpers: fixture paths and tiny random `transformers` checkpoints."""

import gc
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the network

import jax
import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
FIXTURES = Path(os.environ.get("EQX_MODELS_FIXTURES", REPO.parent / "shared" / "fixtures"))
STORIES = FIXTURES / "stories260K"
QWEN_TOKENIZER = FIXTURES / "qwen-tokenizer"


def require_fixture(path: Path) -> Path:
    if not path.exists():
        raise FileNotFoundError(
            f"Test fixture {path} is missing. Put the shared fixtures beside the repository "
            "(../shared/fixtures) or point EQX_MODELS_FIXTURES at them."
        )
    return path


def tiny_config(model_type: str, **overrides):
    """A small `transformers` config of `model_type` with sensible tiny defaults."""
    from transformers import AutoConfig

    base = dict(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    base.update(overrides)
    return AutoConfig.for_model(model_type, **base)


# Models whose `1 + weight` norms (initialised to zero) are drawn around zero, so
# they scale by 1 +- 0.2 like every other family's norms. Gemma's were drawn around
# one before this existed and stay so, keeping their parity tests as they were.
UNIT_OFFSET_NORMS = ("Qwen3Next",)


def randomize_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Re-draws every weight so activations and logits are of order 1-10.

    `transformers` initialises with std 0.02, which makes logits tiny and a 1e-4
    tolerance meaningless; unit-scale weights make the comparison bite.
    """
    generator = torch.Generator().manual_seed(seed)
    saved = set(model.state_dict())
    # Saved buffers are weights too (DeepSeek-V3's routing bias).
    buffers = [(n, b) for n, b in model.named_buffers() if n in saved and b.is_floating_point()]
    with torch.no_grad():
        for name, param in [*model.named_parameters(), *buffers]:
            noise = torch.randn(param.shape, generator=generator)
            if "norm" in name:
                offset = 0.0 if type(model).__name__.startswith(UNIT_OFFSET_NORMS) and not param.any() else 1.0
                param.copy_(offset + 0.2 * noise)
            elif "embed_tokens" in name:
                param.copy_(0.5 * noise)
            elif "bias" in name:
                param.copy_(0.1 * noise)
            else:
                scale = 3.0 if "lm_head" in name else 1.0
                param.copy_(scale * noise / np.sqrt(param.shape[-1]))
    return model


def make_checkpoint(directory: Path, config, seed: int = 0):
    """Saves a randomly weighted `*ForCausalLM` for `config`; returns the torch model."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_(model, seed)
    if config.tie_word_embeddings:
        model.tie_weights()
    model.eval()
    model.save_pretrained(directory)
    return model


@pytest.fixture
def checkpoint_factory(tmp_path):
    """`factory(model_type, **config)` -> (folder, torch model)."""
    counter = iter(range(1000))

    def factory(model_type: str, seed: int = 0, **overrides):
        folder = tmp_path / f"{model_type}-{next(counter)}"
        return folder, make_checkpoint(folder, tiny_config(model_type, **overrides), seed)

    return factory


def torch_logits(model, ids: np.ndarray, attention_mask: np.ndarray | None = None) -> np.ndarray:
    with torch.no_grad():
        kwargs = {} if attention_mask is None else {"attention_mask": torch.tensor(attention_mask)}
        return model(torch.tensor(ids), **kwargs).logits.float().numpy()


def release_compiled_code() -> None:
    """Drops JAX's compiled executables. XLA:CPU maps each executable's code in
    memory areas of its own, and a suite that compiles thousands of programs in one
    process passes the kernel's limit on areas per process (`vm.max_map_count`,
    65530), after which compiling segfaults."""
    jax.clear_caches()
    gc.collect()


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_code_after_each_module():
    yield
    release_compiled_code()


MAPPED_AREAS_BEFORE_RELEASE = 20_000  # of 65530; an 8-device test adds ~1,300


def mapped_areas() -> int:
    """How many memory areas this process has mapped (0 where /proc is missing)."""
    try:
        with open("/proc/self/maps", "rb") as maps:
            return sum(1 for _ in maps)
    except OSError:
        return 0


@pytest.fixture(autouse=True)
def _release_compiled_code_before_the_limit():
    """Within a long module (tests/multidevice compiles 8-device programs in one
    module of 50 tests), releases once the areas approach the limit."""
    yield
    if mapped_areas() > MAPPED_AREAS_BEFORE_RELEASE:
        release_compiled_code()


# The longest items (minutes each, alone on one worker) start first: with
# `pytest -n auto` on a few cores the other workers take the rest meanwhile, instead
# of waiting at the end for one that began late.
LONGEST_FIRST = ("test_sharded_runs_on_eight_cpu_devices",)


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.originalname not in LONGEST_FIRST)
