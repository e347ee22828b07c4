"""The MNIST model of Mesh TensorFlow's README, as a meshtorch graph.

Mesh TF README ("Example Network (MNIST)"): a one-hidden-layer ReLU network written with named
dimensions and no biases::

    hidden = relu(einsum(images[batch, rows, cols], w1[rows, cols, hidden]) -> [batch, hidden])
    logits = einsum(hidden, w2[hidden, classes]) -> [batch, classes]
    loss   = reduce_mean(softmax_cross_entropy_with_logits(logits, one_hot(labels, classes), classes))

followed by ``w <- w - lr * dloss/dw`` for w1 and w2. Differences from the README: the images
and labels are placeholders fed at every step (the README imports TF tensors), the learning rate
is a parameter (README: 0.001; default here 0.1, which suits plain SGD on pixels in [0, 1]), and
the weights are drawn like ``torch.nn.Linear``'s (uniform on ``[-1/sqrt(fan_in), 1/sqrt(fan_in)]``,
i.e. variance scaling with scale 1/3, fan_in, uniform) rather than TF's Glorot default.

Mesh axes and tensor dimensions live in separate namespaces: a layout such as
``"batch:rows;hidden:cols"`` names the mesh axes ``rows``/``cols`` and never splits the image's
``rows``/``cols`` *dimensions* (no rule names them as tensor dims).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from meshtorch.autodiff import gradients
from meshtorch.core.dims import Dimension
from meshtorch.core.graph import Graph, Mesh, Operation, Tensor
from meshtorch.core.mesh_spec import MeshSpec
from meshtorch.layers.core import softmax_cross_entropy_with_logits
from meshtorch.lowering import Lowering
from meshtorch.ops.einsum import einsum
from meshtorch.ops.elementwise import cast, relu
from meshtorch.ops.indexing import one_hot
from meshtorch.ops.initializers import VarianceScalingInitializer
from meshtorch.ops.precision import VariableDType
from meshtorch.ops.reduce import reduce_mean
from meshtorch.ops.variables import get_variable, placeholder
from meshtorch.optim.sgd import SgdOptimizer

IMAGE_ROWS = 28
IMAGE_COLS = 28
NUM_CLASSES = 10


def simulated_spec(mesh_shape, layout, devices) -> MeshSpec:
    """``MeshSpec(mesh_shape, layout)``, for the models' ``make_lowering`` conveniences.

    Raises:
        ValueError: if ``devices`` is given (a backend's argument, not a spec's).
    """
    if devices is not None:
        raise ValueError("make_lowering(devices=...): pass mesh_impl=mtf.PlacementMeshImpl(mesh_shape, layout, "
                         "devices) instead (models plan on mesh specs; devices belong to a backend).")
    return MeshSpec(mesh_shape, layout)


@dataclass
class MnistModel:
    """The built graph and its handles.

    Attributes:
        graph, mesh: the Graph and its (only) Mesh.
        batch, rows, cols, hidden, classes: the Dimensions.
        images: placeholder ``[batch, rows, cols]`` float32 (pixels scaled to [0, 1]).
        labels: placeholder ``[batch]`` int64 (class ids in [0, classes)).
        w1: variable ``[rows, cols, hidden]``; w2: variable ``[hidden, classes]`` (value tensors).
        hidden_activations: ``[batch, hidden]``; logits: ``[batch, classes]``; loss: scalar float32.
        w1_grad, w2_grad: d loss / d w1 and d loss / d w2 (same named shapes as the weights).
        update_ops: the SGD Assign operations; fetch them with ``loss`` to train one step.
    """

    graph: Graph
    mesh: Mesh
    batch: Dimension
    rows: Dimension
    cols: Dimension
    hidden: Dimension
    classes: Dimension
    images: Tensor
    labels: Tensor
    w1: Tensor
    w2: Tensor
    hidden_activations: Tensor
    logits: Tensor
    loss: Tensor
    w1_grad: Tensor
    w2_grad: Tensor
    update_ops: list[Operation] = field(default_factory=list)

    def make_lowering(self, mesh_shape="", layout="", devices=None, mesh_impl=None) -> Lowering:
        """Lower the graph on ``mesh_impl`` (any :class:`~meshtorch.mesh.base.MeshImpl`, e.g. from
        :func:`meshtorch.mesh.make_mesh_impl`, or a :class:`~meshtorch.core.mesh_spec.MeshSpec`), or, for
        convenience, on ``MeshSpec(mesh_shape, layout)`` simulated in this process.

        Args:
            mesh_shape: e.g. ``"rows:2;cols:2"``; ``""`` is one processor.
            layout: e.g. ``"batch:rows;hidden:cols"``.
            devices: no longer taken here: pass ``mesh_impl=PlacementMeshImpl(mesh_shape, layout, devices)``.
            mesh_impl: the mesh implementation to use instead of the three arguments above.

        Raises:
            LayoutError: naming the tensor and dimension if the layout is illegal for this model
                (e.g. ``batch`` size not divisible by the mesh axis).
            ValueError: if ``devices`` is given.
        """
        impl = mesh_impl if mesh_impl is not None else simulated_spec(mesh_shape, layout, devices)
        return Lowering(self.graph, {self.mesh: impl})

    def train_fetches(self) -> list:
        """``[loss] + update_ops``: what one training step fetches."""
        return [self.loss, *self.update_ops]

    def feeds(self, images: torch.Tensor, labels: torch.Tensor) -> dict:
        """Feeds for one batch: images ``[batch, rows, cols]`` (uint8 is scaled by 1/255), labels ``[batch]``."""
        if images.dtype == torch.uint8:
            images = images.to(torch.float32) / 255.0
        return {self.images: images, self.labels: labels.to(torch.int64)}


def build_mnist_model(batch_size: int = 100, hidden_size: int = 1024, learning_rate: float = 0.1,
                      seed: int = 0, rows: int = IMAGE_ROWS, cols: int = IMAGE_COLS,
                      num_classes: int = NUM_CLASSES, activation_dtype: torch.dtype = torch.float32) -> MnistModel:
    """Build the README MNIST model and its SGD update (no layout yet: see ``make_lowering``).

    Args:
        batch_size: size of the ``batch`` dim (the placeholders' batch; fixed per graph).
        hidden_size: size of the ``hidden`` dim.
        learning_rate: SGD step size.
        seed: graph seed; the initial weights are a function of it (and not of the layout).
        rows, cols, num_classes: image and label sizes (28, 28, 10 for (Fashion-)MNIST).
        activation_dtype: dtype of the forward and backward computation (e.g. ``torch.bfloat16``);
            the weights are stored and updated in float32 (``mtf.VariableDType``), and reductions
            accumulate in float32.

    Returns:
        :class:`MnistModel`.

    Raises:
        ValueError: on a non-positive size.
    """
    for what, v in (("batch_size", batch_size), ("hidden_size", hidden_size), ("rows", rows), ("cols", cols),
                    ("num_classes", num_classes)):
        if int(v) <= 0:
            raise ValueError(f"build_mnist_model: {what} must be positive, got {v}.")
    graph = Graph(seed=seed)
    mesh = Mesh(graph, "mesh")
    batch_dim = Dimension("batch", batch_size)
    rows_dim = Dimension("rows", rows)
    cols_dim = Dimension("cols", cols)
    hidden_dim = Dimension("hidden", hidden_size)
    classes_dim = Dimension("classes", num_classes)

    images = placeholder(mesh, "images", [batch_dim, rows_dim, cols_dim], dtype=torch.float32)
    x = images if activation_dtype == torch.float32 else cast(images, activation_dtype)
    vdtype = VariableDType(torch.float32, torch.float32, activation_dtype)
    labels = placeholder(mesh, "labels", [batch_dim], dtype=torch.int64)
    # torch.nn.Linear's scale: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) = variance scaling 1/3, fan_in, uniform
    w1 = get_variable(mesh, "w1", [rows_dim, cols_dim, hidden_dim], dtype=vdtype,
                      initializer=VarianceScalingInitializer(1.0 / 3.0, "fan_in", "uniform",
                                                             reduced_dims=[rows_dim, cols_dim], new_dims=[hidden_dim]))
    w2 = get_variable(mesh, "w2", [hidden_dim, classes_dim], dtype=vdtype,
                      initializer=VarianceScalingInitializer(1.0 / 3.0, "fan_in", "uniform",
                                                             reduced_dims=[hidden_dim], new_dims=[classes_dim]))
    hidden = relu(einsum([x, w1], output_shape=[batch_dim, hidden_dim], name="hidden_einsum"), name="hidden")
    logits = einsum([hidden, w2], output_shape=[batch_dim, classes_dim], name="logits")
    loss = reduce_mean(softmax_cross_entropy_with_logits(logits, one_hot(labels, classes_dim), classes_dim),
                       name="loss")
    w1_grad, w2_grad = gradients([loss], [w1, w2])
    update_ops = SgdOptimizer(learning_rate).apply_grads([w1_grad, w2_grad], [w1, w2])
    return MnistModel(graph, mesh, batch_dim, rows_dim, cols_dim, hidden_dim, classes_dim, images, labels,
                      w1, w2, hidden, logits, loss, w1_grad, w2_grad, update_ops)
