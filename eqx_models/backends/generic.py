"""The reference ops as a `Backend`: what runs where no backend of its own does."""

import jax
import jax.numpy as jnp
from jaxtyping import Array

from . import xla
from .base import Backend


def _index_layer(stack: Array, index: Array) -> Array:
    return jax.lax.dynamic_index_in_dim(stack, index, keepdims=False)


def _take_rows(table: Array, ids: Array) -> Array:
    return jnp.take(table, ids, axis=0, mode="clip")


class Generic(Backend):
    """Every op in plain XLA (`eqx_models.backends.xla`); no choice depends on the machine."""

    def __init__(self, name: str):
        self.name = name

    def reads_layers_in_place(self, x: Array, stack) -> bool:
        return False

    def headwise_in_place(self, rows: int, stack: Array) -> bool:
        return False

    def joins_products(self, x: Array) -> bool:
        # Joining copies the weights; a matmul per weight reads them where they lie.
        return False

    def attends_one_token(self, cache_dtype, softcap: float | None) -> bool:
        return False

    def decode_steps_per_call(self) -> int:
        # The host waits for each donating step to finish before it launches the
        # next: on a TPU v5e about 0.5 ms of idle chip per call, a quarter of a
        # small model's step. Sixteen steps a call keep tokens streaming in
        # chunks of a few tens of milliseconds.
        return 16

    def prefers_quantized_tiles(self) -> bool:
        return False

    stacked_matvecs = staticmethod(xla.stacked_matvecs)
    quantized_matvecs = staticmethod(xla.quantized_matvecs)
    decode_attention = staticmethod(xla.decode_attention)
    paged_decode_attention = staticmethod(xla.paged_decode_attention)
    index_layer = staticmethod(_index_layer)
    take_rows = staticmethod(_take_rows)
    gather_pages = staticmethod(xla.gather_pages)
    greedy_rows = staticmethod(xla.greedy_rows)
    write_slots = staticmethod(xla.write_slots)
    write_pages = staticmethod(xla.write_pages)
    delta_rule_step = staticmethod(xla.delta_rule_step)
    headwise_matvec = staticmethod(xla.headwise_matvec)
