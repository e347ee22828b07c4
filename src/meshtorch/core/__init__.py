"""Named dimensions, shapes, graphs and layout rules. Knows nothing of PyTorch execution."""

from meshtorch.core.dims import Dimension, Shape, convert_to_dimension, convert_to_shape
from meshtorch.core.errors import DataError, FeedError, LayoutError, MeshtorchError, ShapeError
from meshtorch.core.graph import Graph, Mesh, Operation, Tensor
from meshtorch.core.layout import LayoutRules, TensorLayout, convert_to_layout_rules
from meshtorch.core.mesh_spec import MeshSpec, convert_to_mesh_spec

__all__ = [
    "Dimension", "Shape", "convert_to_dimension", "convert_to_shape",
    "DataError", "FeedError", "LayoutError", "MeshtorchError", "ShapeError",
    "Graph", "Mesh", "Operation", "Tensor",
    "LayoutRules", "TensorLayout", "convert_to_layout_rules", "MeshSpec", "convert_to_mesh_spec",
]
