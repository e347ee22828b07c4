"""The slice of the ``mtf`` namespace the transformer package uses, imported from the op modules.

``from meshtorch.transformer import _mtf as mtf`` lets the package read like Mesh TF's source
without importing the top-level ``meshtorch`` package (which imports this package).
"""

from __future__ import annotations

from meshtorch import layers  # noqa: F401  (mtf.layers.*)
from meshtorch.autodiff import recompute_grad  # noqa: F401
from meshtorch.core.dims import Dimension, Shape, convert_to_dimension, convert_to_shape  # noqa: F401
from meshtorch.core.graph import Mesh, Tensor  # noqa: F401
from meshtorch.core.scopes import get_variable_scope, variable_scope  # noqa: F401
from meshtorch.ops.activations import logical_not, to_int32  # noqa: F401
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
    mod,
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
from meshtorch.ops.reduce_more import reduce_all  # noqa: F401
from meshtorch.ops.reshape import rename_dimension, replace_dimensions, reshape, transpose  # noqa: F401
from meshtorch.ops.selection import argmax, nth_largest_element, top_k  # noqa: F401
from meshtorch.ops.sequence import cumsum, range, shift  # noqa: F401,A004
from meshtorch.ops.shape import add_n, broadcast, concat, slice, where  # noqa: F401,A004
from meshtorch.ops.variables import constant, get_variable, import_tensor, ones_like, zeros, zeros_like  # noqa: F401
