"""XLA:CPU options that let a batch-1 matrix-vector product read a stacked layer in place.

Imported before anything touches a JAX backend. Under `jax.lax.scan`, XLA:CPU
copies the current layer's slice of a stacked weight before every `dot`. Written
as multiply + sum over the contiguous last axis, the slice fuses into the
reduction loop and no copy is made, but only when YNNPACK does not take over the
reduction and the tree-reduction rewrite is off (otherwise it is far slower).
The options are process-wide, so they are added only when the backend has not
started yet, and `REDUCTION_MATVEC` records whether they are in force; set
`EQX_MODELS_XLA_FLAGS=0` to leave XLA_FLAGS alone.
"""

import os

DECODE_FLAGS = (
    "--xla_cpu_experimental_ynn_fusion_type=-reduce",
    "--xla_disable_hlo_passes=tree_reduction_rewriter",
)


def _backend_started() -> bool:
    try:
        from jax._src import xla_bridge

        return bool(getattr(xla_bridge, "_backends", None))
    except ImportError:  # pragma: no cover - jax internals moved
        return True


def _install() -> bool:
    current = os.environ.get("XLA_FLAGS", "")
    if all(flag in current for flag in DECODE_FLAGS):
        return True
    if os.environ.get("EQX_MODELS_XLA_FLAGS", "1") == "0" or _backend_started():
        return False
    if "--xla_disable_hlo_passes=" in current:  # one list only: XLA keeps the last
        return False
    os.environ["XLA_FLAGS"] = " ".join([current, *DECODE_FLAGS]).strip()
    return True


REDUCTION_MATVEC: bool = _install()
