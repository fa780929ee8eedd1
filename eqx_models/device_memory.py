"""An accelerator's free memory, and refusing what would not fit in it before it is
allocated: an error that says the bytes needed, the bytes free and what would
fit, in place of XLA's RESOURCE_EXHAUSTED from deep inside a compile or a copy.

Only devices that report their memory (`jax.Device.memory_stats()`: TPUs and
GPUs) are checked; the CPU reports none, and there the operating system's
memory (and the mapped checkpoint files) is the limit.
"""

from collections.abc import Iterable, Sequence

import jax

GIB = 1 << 30


class OutOfDeviceMemory(MemoryError):
    """What was asked for does not fit the accelerator's free memory (the message
    names the bytes and what would fit)."""


def gib(count: int | float) -> str:
    """Bytes as GiB, for messages."""
    return f"{count / GIB:.2f} GiB"


def memory_stats(device: jax.Device) -> dict | None:
    """`device.memory_stats()`: what the runtime reports (None on the CPU)."""
    return device.memory_stats()


def free_bytes(devices: Iterable[jax.Device]) -> tuple[int, int, jax.Device] | None:
    """The free bytes, the total and the device, of the one among `devices` with
    the least free memory; None where any device does not report its memory."""
    least = None
    for device in devices:
        stats = memory_stats(device)
        if not stats or "bytes_limit" not in stats:
            return None
        limit = int(stats["bytes_limit"])
        free = limit - int(stats.get("bytes_in_use", 0))
        if least is None or free < least[0]:
            least = (free, limit, device)
    return least


def refuse_unless_fits(what: str, needed: int, devices: Iterable[jax.Device], fixes: Sequence[str]) -> None:
    """Raises `OutOfDeviceMemory` when `needed` bytes (per device) are more than
    the least free memory among `devices`; the message describes `what` and lists
    `fixes` (what would fit). Nothing happens where the devices report no memory."""
    free = free_bytes(devices)
    if free is None or needed <= free[0]:
        return
    available, limit, device = free
    options = "".join(f"\n  - {fix}" for fix in fixes) if fixes else ""
    exact = lambda count: f"{gib(count)} ({count:,} bytes)"
    raise OutOfDeviceMemory(
        f"{what} needs {exact(needed)} on {device}, which has {exact(available)} free of {gib(limit)} "
        f"(the rest holds arrays already there: weights, caches, programs). Nothing was allocated."
        + (f" What would fit:{options}" if options else "")
    )


def is_out_of_memory(error: BaseException) -> bool:
    """Whether `error` is XLA running out of device memory (at compile or run time)."""
    return isinstance(error, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in str(error)
