"""Backends: how each op of `eqx_models.ops` runs on one kind of machine.

The choice is made here and nowhere else: `active_backend()` answers for JAX's
default backend, the platform the model is traced for.

- `cpu` (`backends/cpu/`): C++ kernels through XLA's FFI that read each layer in
  place, compiled the first time a model on the CPU needs them.
- `tpu` (`backends/tpu/`): Pallas kernels where they pay (decode attention over
  the live part of the cache), XLA's own operations elsewhere.
- any other platform (`gpu`, ...): the reference ops in plain XLA
  (`backends/xla.py`, as `Generic`). A platform's own kernels (Pallas / Triton on
  a GPU) go in its own module here, as a final `Backend` subclass listed in
  `_BACKENDS`.
"""

import functools

import jax

from .base import Backend
from .cpu import Cpu
from .generic import Generic
from .tpu import Tpu

_BACKENDS: dict[str, type[Backend]] = {"cpu": Cpu, "tpu": Tpu}


@functools.cache
def _backend_for(platform: str) -> Backend:
    kind = _BACKENDS.get(platform)
    return kind() if kind is not None else Generic(platform)


def active_backend() -> Backend:
    """The backend of JAX's default platform (`jax.default_backend()`)."""
    return _backend_for(jax.default_backend())


__all__ = ["Backend", "active_backend"]
