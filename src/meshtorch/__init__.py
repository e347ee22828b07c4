"""meshtorch: Mesh TensorFlow's named-dimension model parallelism, on PyTorch.

``import meshtorch as mtf`` gives a flat API with Mesh TF's names where the concept is the same.
"""

from meshtorch import beam_search, layers, optim, optimize, placement_mesh_impl
from meshtorch.autodiff import gradients, recompute_grad
from meshtorch._version import __version__
from meshtorch.checkpoint import hf
from meshtorch.checkpoint import (
    CheckpointError,
    from_torch_state_dict,
    latest_checkpoint,
    load_manifest,
    restore,
    save,
    to_torch_state_dict,
)
from meshtorch.core import (
    DataError,
    Dimension,
    FeedError,
    Graph,
    LayoutError,
    LayoutRules,
    Mesh,
    MeshSpec,
    MeshtorchError,
    Operation,
    Shape,
    ShapeError,
    Tensor,
    TensorLayout,
    convert_to_dimension,
    convert_to_shape,
)
from meshtorch.core.scopes import AUTO_REUSE, VariableScope, get_variable_scope, name_scope, variable_scope
from meshtorch.lowering.counters import Collective, Counters
from meshtorch.lowering import Lowering, Program, Session, VariableStore
from meshtorch.lowering.kernels import NotDataError
from meshtorch.mesh import MeshImpl, PlacementMeshImpl, collective_report, flight_recorder
from meshtorch.mesh.spmd import SpmdMeshImpl
from meshtorch.planning import CostModel, MemoryReport, memory_report, search_layouts
from meshtorch.ops.binary import (
    add,
    divide,
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
    floordiv,
    mod,
    sub,
    subtract,
)
from meshtorch.ops.einsum import einsum, matmul
from meshtorch.ops.elementwise import (
    abs,  # noqa: A004
    cast,
    exp,
    gelu,
    identity,
    log,
    negative,
    reciprocal,
    relu,
    rsqrt,
    sigmoid,
    sign,
    slicewise,
    sqrt,
    square,
    stop_gradient,
    tanh,
)
from meshtorch.ops.indexing import *  # noqa: F403  (each family module lists its API in __all__)
from meshtorch.ops.selection import *  # noqa: F403
from meshtorch.ops.initializers import (
    Initializer,
    VarianceScalingInitializer,
    constant_initializer,
    glorot_uniform_initializer,
    ones_initializer,
    random_normal_initializer,
    random_uniform_initializer,
    truncated_normal_initializer,
    zeros_initializer,
)
from meshtorch.ops.reduce import (
    log_softmax,
    reduce_logsumexp,
    reduce_max,
    reduce_mean,
    reduce_min,
    reduce_sum,
    softmax,
)
from meshtorch.ops.shape import *  # noqa: F403
from meshtorch.ops.reshape import *  # noqa: F403
from meshtorch.ops.random import *  # noqa: F403
from meshtorch.ops.conv import *  # noqa: F403
from meshtorch.ops.conv_blocks import *  # noqa: F403
from meshtorch.ops.pool import *  # noqa: F403
from meshtorch.ops.control import *  # noqa: F403
from meshtorch.ops.precision import *  # noqa: F403
from meshtorch.ops.activations import *  # noqa: F403
from meshtorch.ops.reduce_more import *  # noqa: F403
from meshtorch.ops.sequence_more import *  # noqa: F403
from meshtorch.ops.graph_helpers import *  # noqa: F403
from meshtorch.ops.rotary import *  # noqa: F403
from meshtorch.ops.xent import *  # noqa: F403
from meshtorch.core.processors import *  # noqa: F403
from meshtorch.core import convert_to_layout_rules
from meshtorch.layers.conv_backprop import *  # noqa: F403  (built with autodiff: above it)
from meshtorch.mesh.devices import parallel
from meshtorch.ops.variables import (
    Variable,
    assign,
    assign_add,
    assign_add_slice,
    assign_slice,
    assign_sub,
    assign_sub_slice,
    constant,
    get_variable,
    import_fully_replicated,
    import_laid_out_tensor,
    import_tensor,
    ones,
    ones_like,
    placeholder,
    zeros,
    zeros_like,
)

import_tf_tensor = import_tensor  # Mesh TF's name
mtf_slice = slice  # noqa: F405 - Mesh TF exports its mtf_slice as mtf.slice; both names exist there

from meshtorch import transformer  # noqa: E402  (mtf.transformer; built on the names above)
