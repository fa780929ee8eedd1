"""The matmul precision the TPU kernels are traced at.

Pallas' dots take their precision from JAX's setting when they are traced, and
Mosaic refuses a 16-bit product at HIGHEST ("Bad lhs type"): a bfloat16 model run
under `jax.default_matmul_precision("highest")` would not compile. A 16-bit
product is exact at any precision (its terms accumulate in float32), so kernels
with 16-bit inputs are traced at the default precision, forward and backward;
float32 inputs keep the caller's setting. A float32 input beside a 16-bit one
takes the default too: Mosaic refuses their product at HIGHEST as well.
"""

import contextlib

import jax
import jax.numpy as jnp


def _any_16_bit(dtypes) -> bool:
    return any(jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype).itemsize == 2 for dtype in dtypes)


def for_inputs(*dtypes) -> contextlib.AbstractContextManager:
    """The precision to trace a kernel with inputs of `dtypes` at (a context)."""
    if _any_16_bit(dtypes):
        return jax.default_matmul_precision("default")
    return contextlib.nullcontext()


def traced_for_inputs(fn, *dtypes):
    """`fn` traced at `for_inputs(*dtypes)`, its derivative too: a kernel's own
    backward pass is traced when the derivative is taken, after `fn` returned."""
    if not _any_16_bit(dtypes):
        return fn

    @jax.custom_vjp
    def run(*args):
        with for_inputs(*dtypes):
            return fn(*args)

    def forward(*args):
        with for_inputs(*dtypes):
            return jax.vjp(fn, *args)

    def backward(pullback, cotangent):
        with for_inputs(*dtypes):
            return pullback(cotangent)

    run.defvjp(forward, backward)
    return run
