"""The slice of the ``mtf`` namespace the transformer package uses, imported from the op modules.

``from meshtorch.transformer import _mtf as mtf`` lets the package read like Mesh TF's source
without importing the top-level ``meshtorch`` package (which imports this package). The few
helpers below are compositions of graph ops for Mesh TF names this package needs.
"""

from __future__ import annotations

import torch

from meshtorch import layers  # noqa: F401  (mtf.layers.*)
from meshtorch.autodiff import recompute_grad  # noqa: F401
from meshtorch.core.dims import Dimension, Shape, convert_to_dimension, convert_to_shape  # noqa: F401
from meshtorch.core.graph import Mesh, Tensor  # noqa: F401
from meshtorch.core.scopes import get_variable_scope, variable_scope  # noqa: F401
from meshtorch.ops.binary import (  # noqa: F401
    add,
    equal,
    greater,
    greater_equal,
    less,
    less_equal,
    logical_and,
    logical_or,
    maximum,
    minimum,
    multiply,
    not_equal,
)
from meshtorch.ops.control import while_loop  # noqa: F401
from meshtorch.ops.einsum import einsum  # noqa: F401
from meshtorch.ops.elementwise import abs, cast, exp, gelu, log, negative, relu, rsqrt, sigmoid, square, tanh  # noqa: F401,A004
from meshtorch.ops.indexing import gather, one_hot  # noqa: F401
from meshtorch.ops.initializers import (  # noqa: F401
    VarianceScalingInitializer,
    ones_initializer,
    random_normal_initializer,
    zeros_initializer,
)
from meshtorch.ops.precision import VariableDType  # noqa: F401
from meshtorch.ops.random import dropout, random_uniform  # noqa: F401
from meshtorch.ops.reduce import log_softmax, reduce_logsumexp, reduce_max, reduce_mean, reduce_min, reduce_sum, softmax  # noqa: F401
from meshtorch.ops.reshape import rename_dimension, replace_dimensions, reshape, transpose  # noqa: F401
from meshtorch.ops.selection import argmax, nth_largest_element, top_k  # noqa: F401
from meshtorch.ops.sequence import cumsum, range, shift  # noqa: F401,A004
from meshtorch.ops.shape import add_n, broadcast, concat, slice, where  # noqa: F401,A004
from meshtorch.ops.variables import constant, get_variable, import_tensor, ones_like, zeros, zeros_like  # noqa: F401


def to_int32(x: Tensor) -> Tensor:
    """``cast(x, int32)`` (Mesh TF ``mtf.to_int32``)."""
    return cast(x, torch.int32)


def logical_not(x: Tensor) -> Tensor:
    """Boolean negation, as ``x == 0`` on the int32 cast (Mesh TF ``mtf.logical_not``)."""
    return equal(cast(x, torch.int32), 0)


def reduce_all(x: Tensor) -> Tensor:
    """Scalar bool: every element true (Mesh TF ``mtf.reduce_all``), as ``min(int32(x)) > 0``."""
    return greater(reduce_min(cast(x, torch.int32)), 0)


def mod_2(x: Tensor) -> Tensor:
    """``x mod 2`` for integer ``x >= 0``, as ``x - 2 * floor(x / 2)`` on float64 (exact below 2**52)."""
    xf = cast(x, torch.float64)
    half = cast(cast(xf * 0.5, torch.int64), torch.float64)  # truncation == floor for x >= 0
    return cast(xf - half * 2.0, x.dtype)
