"""What a backend provides: the ops of `eqx_models.ops`, and the few choices that
depend on the machine (which rows a layer's in-place product suits, whether one
token's attention reads the cache in place, which layout quantized weights take).

Every backend is a final subclass of `Backend` implementing all of it; where it
has nothing faster it points at the reference (`eqx_models.backends.xla`).
Arguments are those of the op of the same name in `eqx_models.ops`, already
checked and converted there.
"""

import abc

from jaxtyping import Array


class Backend(abc.ABC):
    """The ops as one machine runs them (see `eqx_models.ops` for each contract)."""

    name: str

    @abc.abstractmethod
    def reads_layers_in_place(self, x: Array, stack) -> bool:
        """Whether `x`'s rows times one layer of `stack` (a `[layers, out, in]`
        array or `QuantizedWeight`) go through `stacked_matvecs` /
        `quantized_matvecs` rather than a matmul of the layer's slice."""

    @abc.abstractmethod
    def headwise_in_place(self, rows: int, stack: Array) -> bool:
        """Whether `rows` rows' per-head products with one layer of `stack` go
        through `headwise_matvec` rather than an einsum of the layer's slice."""

    @abc.abstractmethod
    def joins_products(self, x: Array) -> bool:
        """Whether `x`'s products with several weights (q/k/v, gate/up) go as one
        matmul over the weights joined, a copy of them, rather than one each."""

    @abc.abstractmethod
    def attends_one_token(self, cache_dtype, softcap: float | None) -> bool:
        """Whether a one-token step attends through `decode_attention` /
        `paged_decode_attention` for a cache of `cache_dtype`."""

    @abc.abstractmethod
    def groups_experts(self, stack) -> bool:
        """Whether mixture-of-experts layers with experts stacked as `stack`
        (`[layers, experts, out, in]`, float or `QuantizedWeight`) run them through
        `grouped_matmul` rather than a loop over blocks of assignments."""

    @abc.abstractmethod
    def decode_steps_per_call(self) -> int:
        """How many decode steps `generate` runs per call of a compiled program
        (one where launching a program costs little next to a step)."""

    @abc.abstractmethod
    def prefers_quantized_tiles(self) -> bool:
        """Whether int8 weights are best kept in the "tiles" layout."""

    @abc.abstractmethod
    def prefers_ragged_steps(self) -> bool:
        """Whether the serving engine runs a step's prompt chunks and decodes as one
        ragged batch (`RaggedPagedKVCache`) rather than one call per chunk length
        and one for the decodes."""

    @abc.abstractmethod
    def stacked_matvecs(self, x: Array, stacks: tuple[Array, ...], layer: Array) -> tuple[Array, ...]: ...

    @abc.abstractmethod
    def quantized_matvecs(self, x: Array, stacks: tuple, layer: Array) -> tuple[Array, ...]: ...

    @abc.abstractmethod
    def masked_attention(self, query, keys, values, allowed, scale, softcap, sinks) -> Array: ...

    @abc.abstractmethod
    def causal_attention(self, query, keys, values, attention_mask, segment_ids, window, scale, softcap,
                         sinks) -> Array: ...

    @abc.abstractmethod
    def grouped_matmul(self, rows: Array, stack: Array, layer: Array, group_sizes: Array) -> Array: ...

    @abc.abstractmethod
    def decode_attention(self, query, key_stack, value_stack, layer, valid, self_valid, new_key, new_value, sinks,
                         key_scales, value_scales, scale) -> Array: ...

    @abc.abstractmethod
    def paged_decode_attention(self, query, key_pool, value_pool, layer, block_tables, valid, self_valid, new_key,
                               new_value, sinks, key_scales, value_scales, scale) -> Array: ...

    @abc.abstractmethod
    def ragged_paged_attention(self, query, new_keys, new_values, key_pool, value_pool, layer, block_tables, tokens,
                               sinks, key_scales, value_scales, scale, softcap) -> Array: ...

    @abc.abstractmethod
    def index_layer(self, stack: Array, index: Array) -> Array: ...

    @abc.abstractmethod
    def take_rows(self, table: Array, ids: Array) -> Array: ...

    @abc.abstractmethod
    def gather_pages(self, pool: Array, layer: Array, block_tables: Array) -> Array: ...

    @abc.abstractmethod
    def greedy_rows(self, logits: Array) -> Array: ...

    @abc.abstractmethod
    def write_slots(self, buffer: Array, update: Array, start: Array, wrap: bool) -> Array: ...

    @abc.abstractmethod
    def write_pages(self, pool: Array, update: Array, slots: Array) -> Array: ...

    @abc.abstractmethod
    def delta_rule_step(self, pool, layer, slots, fresh, q, k, v, g, beta, member) -> tuple[Array, Array]: ...

    @abc.abstractmethod
    def headwise_matvec(self, x, stack, layer, heads, row_start, rows, transpose) -> Array: ...
