"""The reference ops as a `Backend`: what runs where no backend of its own does."""

import jax
import jax.numpy as jnp
from jaxtyping import Array

from . import xla
from .base import Backend


def index_layer(stack: Array, index: Array) -> Array:
    return jax.lax.dynamic_index_in_dim(stack, index, keepdims=False)


def take_rows(table: Array, ids: Array) -> Array:
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

    def groups_experts(self, stack) -> bool:
        return isinstance(stack, Array)  # one ragged product over every assignment

    def decode_steps_per_call(self) -> int:
        return 16  # as on a TPU (see `Tpu.decode_steps_per_call`): an accelerator's launch is not free

    def prefers_quantized_tiles(self) -> bool:
        return False

    def prefers_ragged_steps(self) -> bool:
        return True  # an accelerator waits on each launch; one call a step, nothing padded

    stacked_matvecs = staticmethod(xla.stacked_matvecs)
    quantized_matvecs = staticmethod(xla.quantized_matvecs)
    masked_attention = staticmethod(xla.masked_attention)
    causal_attention = staticmethod(xla.causal_attention)
    grouped_matmul = staticmethod(xla.grouped_matmul)
    decode_attention = staticmethod(xla.decode_attention)
    paged_decode_attention = staticmethod(xla.paged_decode_attention)
    ragged_paged_attention = staticmethod(xla.ragged_paged_attention)
    index_layer = staticmethod(index_layer)
    take_rows = staticmethod(take_rows)
    gather_pages = staticmethod(xla.gather_pages)
    greedy_rows = staticmethod(xla.greedy_rows)
    write_slots = staticmethod(xla.write_slots)
    write_pages = staticmethod(xla.write_pages)
    delta_rule_step = staticmethod(xla.delta_rule_step)
    headwise_matvec = staticmethod(xla.headwise_matvec)
