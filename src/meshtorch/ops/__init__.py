"""Operation families, one file each. Each Operation owns its shape inference, lower() and gradient().

The few gradient rules that need a family built on the op's own (reduce_sum <-> broadcast, binary ops'
sums over broadcast dims) are registered by :mod:`meshtorch.ops.gradients`, imported here so they are
in place whenever any op module is.
"""

from meshtorch.ops import gradients  # noqa: F401  (registers gradient rules)
