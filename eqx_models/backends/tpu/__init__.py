"""The TPU backend: Pallas kernels where one pays, the reference XLA ops elsewhere.

- one token's attention to the dense cache (`attention.py`): reads each row's
  live blocks of slots only, the layer's slice in place; to the paged pool
  (`paged.py`, the serving engine's decodes): each row's live pages, in place;
- the experts' grouped product (`experts.py`): megablox `gmm` over the layer's
  used experts, read in place;
- the new tokens' attention to each other (`splash.py`): splash attention over
  the blocks its causal or sliding-window mask keeps;
- a few rows times a layer of int8 weights (`quantized.py`): the integers read
  in place and widened in VMEM, never a float copy of the layer.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jaxtyping import Array

from ...sharding import spans_devices
from .. import xla
from ..base import Backend
from ..generic import index_layer, take_rows
from . import attention, experts, paged, quantized, splash

# Rows (tokens) up to which int8 products go through the kernel.
MAX_QUANTIZED_KERNEL_ROWS = 1024


def _decode_attention(query, key_stack, value_stack, layer, valid, self_valid, new_key, new_value, sinks, key_scales,
                      value_scales, scale):
    args = (query, key_stack, value_stack, layer, valid, self_valid, new_key, new_value, sinks)
    reference = lambda *args: xla.decode_attention(*args, key_scales, value_scales, scale)
    if not attention.fits(query, key_stack, value_stack, new_value, key_scales, value_scales):
        return reference(*args)
    kernel = lambda *args: attention.decode_attention(*args, scale)
    # Arrays placed on the host's CPU of a TPU machine lower for the CPU: the reference.
    return jax.lax.platform_dependent(*args, tpu=kernel, default=reference)


def _paged_decode_attention(query, key_pool, value_pool, layer, block_tables, valid, self_valid, new_key, new_value,
                            sinks, key_scales, value_scales, scale):
    args = (query, key_pool, value_pool, layer, block_tables, valid, self_valid, new_key, new_value, sinks)
    reference = lambda *args: xla.paged_decode_attention(*args, key_scales, value_scales, scale)
    # A Mosaic call is not split by the partitioner: on a mesh XLA would gather the
    # whole pool to every device first.
    if spans_devices() or not paged.fits(query, key_pool, value_pool, block_tables, new_value, key_scales,
                                         value_scales):
        return reference(*args)
    kernel = lambda *args: paged.paged_decode_attention(*args, scale)
    return jax.lax.platform_dependent(*args, tpu=kernel, default=reference)


def _grouped_matmul(rows, stack, layer, group_sizes):
    if not experts.fits(rows, stack):
        return xla.grouped_matmul(rows, stack, layer, group_sizes)
    return jax.lax.platform_dependent(rows, stack, layer, group_sizes, tpu=experts.grouped_matmul,
                                      default=xla.grouped_matmul)


def _takes_quantized(x: Array, stack) -> bool:
    # A prompt's many rows reuse each weight: XLA's one dequantized copy a layer pays
    # there. On a mesh XLA would gather the whole stack to every device for a Mosaic call.
    return quantized.fits(stack) and math.prod(x.shape[:-1]) <= MAX_QUANTIZED_KERNEL_ROWS and not spans_devices()


def _quantized_matvecs(x, stacks, layer):
    if not all(_takes_quantized(x, stack) for stack in stacks):
        return xla.quantized_matvecs(x, stacks, layer)
    return jax.lax.platform_dependent(x, stacks, layer, tpu=quantized.quantized_matvecs,
                                      default=xla.quantized_matvecs)


def _causal_attention(query, keys, values, attention_mask, segment_ids, window, scale, softcap, sinks):
    reference = lambda q, k, v, m, s: xla.causal_attention(q, k, v, m, s, window, scale, softcap, sinks)
    if not splash.fits(query, keys, values, window, sinks):
        return reference(query, keys, values, attention_mask, segment_ids)
    kernel = lambda q, k, v, m, s: splash.causal_attention(q, k, v, m, s, window, scale, softcap)
    return jax.lax.platform_dependent(query, keys, values, attention_mask, segment_ids, tpu=kernel, default=reference)


class Tpu(Backend):
    """A TPU: XLA's own matmuls (they read a scanned layer's weights in place),
    the Pallas decode attention over the live part of the cache."""

    name = "tpu"

    def reads_layers_in_place(self, x: Array, stack) -> bool:
        # Float layers: XLA's matmul reads a scanned layer in place already.
        return _takes_quantized(x, stack)

    def headwise_in_place(self, rows: int, stack: Array) -> bool:
        return False

    def joins_products(self, x: Array) -> bool:
        return False  # joining copies the weights; a matmul per weight reads them where they lie

    def attends_one_token(self, cache_dtype, softcap: float | None) -> bool:
        return softcap is None and jnp.dtype(cache_dtype) in (jnp.float32, jnp.bfloat16)

    def groups_experts(self, stack) -> bool:
        # One kernel over every assignment, where blocks of them would run one
        # after another; quantized experts, and widths the kernel does not tile,
        # keep the blocks (which read each used expert in place).
        return isinstance(stack, Array) and experts.fits_stack(stack)

    def decode_steps_per_call(self) -> int:
        # The host waits for each donating step to finish before it launches the
        # next (about 0.5 ms of idle chip a call on a v5e, a quarter of a small
        # model's step); sixteen steps a call still stream tokens every few tens
        # of milliseconds.
        return 16

    def prefers_quantized_tiles(self) -> bool:
        return False

    def prefers_ragged_steps(self) -> bool:
        return True  # one call a step: the chip never waits on a second launch, nothing padded

    stacked_matvecs = staticmethod(xla.stacked_matvecs)
    quantized_matvecs = staticmethod(_quantized_matvecs)
    masked_attention = staticmethod(xla.masked_attention)
    causal_attention = staticmethod(_causal_attention)
    grouped_matmul = staticmethod(_grouped_matmul)
    decode_attention = staticmethod(_decode_attention)
    paged_decode_attention = staticmethod(_paged_decode_attention)
    ragged_paged_attention = staticmethod(functools.partial(xla.ragged_paged_attention, decode=_paged_decode_attention))
    index_layer = staticmethod(index_layer)
    take_rows = staticmethod(take_rows)
    gather_pages = staticmethod(xla.gather_pages)
    greedy_rows = staticmethod(xla.greedy_rows)
    write_slots = staticmethod(xla.write_slots)
    write_pages = staticmethod(xla.write_pages)
    delta_rule_step = staticmethod(xla.delta_rule_step)
    headwise_matvec = staticmethod(xla.headwise_matvec)
