"""The contract of a module that holds arrays of its own: it declares their logical axes.

`eqx_models.sharding` places each array by the logical axes (`embed`, `heads`, `mlp`,
...) that the module holding it declares. This module imports nothing from
`eqx_models`, so every module that holds arrays (the blocks, the caches, the quantized
weights) can extend its base without an import running back up.
"""

import abc

import equinox as eqx


class AbstractHasArrayAxes(eqx.Module):
    """A module that holds arrays itself (not only inside child modules) and names
    their logical axes, so `eqx_models.sharding` can place them on a mesh."""

    @abc.abstractmethod
    def array_axes(self) -> dict[str, tuple[str | None, ...]]:
        """The logical axes of this module's own arrays.

        Returns:
            Field name -> one logical axis name (or None: never split) per
            dimension of that array as the module would hold it alone (one layer,
            one expert), without the leading axes a `stacked_field` adds. A field
            not named here is a child module (or None) to walk into.
        """
