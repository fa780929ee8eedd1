"""What a model and its cache take in memory, from shapes alone."""

import math
from collections.abc import Mapping

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType

from .cache import KVCache
from .nn.causal_lm import CausalLM
from .sharding import Placement, head_counts, per_device_bytes, resolve_rules


def _is_shape(x) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct)


def memory_plan(
    config,
    mesh_shape: Mapping[str, int],
    sharding=None,
    *,
    dtype=None,
    batch_size: int = 0,
    max_length: int = 0,
) -> dict:
    """Bytes per device of a model with `config` (and of a `batch_size` x `max_length`
    KV cache) on a mesh of `mesh_shape`, from shapes alone (`eqx.filter_eval_shape`):
    nothing is allocated, and no devices are needed.

    Returns a dict with the mesh, the device count, parameter and cache bytes in all
    and per device, and `per_device_bytes` (their sum).
    """
    names, sizes = tuple(mesh_shape), tuple(mesh_shape.values())
    mesh = jax.sharding.AbstractMesh(sizes, names, axis_types=(AxisType.Auto,) * len(names))
    placement = Placement(mesh, resolve_rules(sharding), head_counts(config))
    skeleton = eqx.filter_eval_shape(CausalLM, config, key=jax.random.key(0))
    if dtype is not None:
        skeleton = jax.tree.map(
            lambda s: jax.ShapeDtypeStruct(s.shape, dtype) if jnp.issubdtype(s.dtype, jnp.floating) else s,
            skeleton,
        )
    params = eqx.filter(skeleton, _is_shape)
    total = lambda tree: sum(math.prod(s.shape) * np.dtype(s.dtype).itemsize for s in jax.tree.leaves(tree))
    plan = {
        "mesh": dict(mesh_shape),
        "devices": math.prod(sizes),
        "parameter_bytes": total(params),
        "parameter_bytes_per_device": per_device_bytes(params, placement),
        "cache_bytes": 0,
        "cache_bytes_per_device": 0,
    }
    if batch_size and max_length:
        # As `init_cache` makes it: a ring of `sliding_window` slots when every layer slides.
        window = config.sliding_window if config.sliding_layers and all(config.sliding_layers) else None
        cache = jax.eval_shape(lambda: KVCache.for_config(config, batch_size, max_length, dtype or jnp.float32, window))
        plan["cache_bytes"] = total(cache)
        plan["cache_bytes_per_device"] = per_device_bytes(cache, placement)
    plan["per_device_bytes"] = plan["parameter_bytes_per_device"] + plan["cache_bytes_per_device"]
    return plan
