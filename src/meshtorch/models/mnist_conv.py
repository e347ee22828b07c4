"""The convolutional MNIST model of Mesh TensorFlow's ``examples/mnist.py``, spatially partitioned.

Mesh TF (``mnist_model``): the 28 x 28 image is cut into 4 x 4 blocks of 7 x 7 pixels,
``[batch, row_blocks:4, col_blocks:4, rows_size:7, cols_size:7, one_channel:1]``; two 9 x 9 SAME
convolutions with 16 filters each (``conv2d_with_blocks``, ReLU after each), the mean over the
filters, two ReLU dense layers of ``hidden_size`` (the first contracts the four image dims), a
dense layer to 10 logits and the mean softmax cross-entropy. Default mesh ``"b1:2;b2:2"`` with
layout ``"row_blocks:b1;col_blocks:b2"``: each processor holds a 2 x 2 quarter of every image and
the convolutions exchange 4-pixel halos with the neighbouring processors.

Differences from Mesh TF: the blocked image is built on the host (:func:`to_blocks`) and fed as a
placeholder (Mesh TF reshapes and transposes inside the graph); the optimizer is momentum SGD
(``torch.optim.SGD`` semantics; Mesh TF uses Adafactor) unless another is passed; the filters start
He-normal (variance 2 / (81 x in_channels); Mesh TF: TF's Glorot-uniform default), which lets plain
momentum SGD train the ReLU convolutions from the first steps; images are scaled to ``[0, 1]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from meshtorch.autodiff import gradients
from meshtorch.core.dims import Dimension
from meshtorch.core.graph import Graph, Mesh, Operation, Tensor
from meshtorch.layers.conv import conv2d_with_blocks
from meshtorch.layers.core import dense, softmax_cross_entropy_with_logits
from meshtorch.lowering import Lowering
from meshtorch.mesh.placement import PlacementMeshImpl
from meshtorch.ops.binary import minimum
from meshtorch.ops.elementwise import relu
from meshtorch.ops.indexing import one_hot
from meshtorch.ops.initializers import VarianceScalingInitializer
from meshtorch.ops.reduce import reduce_mean
from meshtorch.ops.variables import assign_add, get_variable, placeholder
from meshtorch.optim.sgd import MomentumOptimizer

DEFAULT_MESH = "b1:2;b2:2"
DEFAULT_LAYOUT = "row_blocks:b1;col_blocks:b2"
ROW_BLOCKS = COL_BLOCKS = 4
NUM_CLASSES = 10


def to_blocks(images, row_blocks: int = ROW_BLOCKS, col_blocks: int = COL_BLOCKS) -> torch.Tensor:
    """``[batch, H, W]`` images -> ``[batch, row_blocks, col_blocks, H / row_blocks, W / col_blocks, 1]`` float32.

    Block ``(i, j)`` holds rows ``i*rs .. i*rs+rs-1`` and columns ``j*cs .. j*cs+cs-1``; uint8 pixels
    are scaled by 1/255. Raises ValueError if H or W does not divide by the number of blocks.
    """
    x = torch.as_tensor(np.asarray(images)) if not isinstance(images, torch.Tensor) else images
    if x.ndim != 3:
        raise ValueError(f"to_blocks: expected images [batch, rows, cols], got shape {list(x.shape)}.")
    b, h, w = x.shape
    if h % row_blocks or w % col_blocks:
        raise ValueError(f"to_blocks: image {h}x{w} does not divide into {row_blocks}x{col_blocks} blocks.")
    x = x.to(torch.float32) / 255.0 if x.dtype == torch.uint8 else x.to(torch.float32)
    x = x.reshape(b, row_blocks, h // row_blocks, col_blocks, w // col_blocks).permute(0, 1, 3, 2, 4)
    return x.unsqueeze(-1).contiguous()


@dataclass
class ConvMnistModel:
    """The built graph and its handles.

    Attributes:
        graph, mesh: the Graph and its Mesh.
        images: placeholder ``[batch, row_blocks, col_blocks, rows_size, cols_size, one_channel]``
            float32 (feed :func:`to_blocks` of the images, or use :meth:`feeds`).
        labels: placeholder ``[batch]`` int64.
        logits: ``[batch, classes]``; loss: scalar mean cross-entropy.
        update_ops: optimizer Assign operations; fetch them with ``loss`` to train one step.
    """

    graph: Graph
    mesh: Mesh
    batch: Dimension
    classes: Dimension
    images: Tensor
    labels: Tensor
    logits: Tensor
    loss: Tensor
    update_ops: list[Operation] = field(default_factory=list)
    row_blocks: int = ROW_BLOCKS
    col_blocks: int = COL_BLOCKS

    def make_lowering(self, mesh_shape=DEFAULT_MESH, layout=DEFAULT_LAYOUT, devices=None) -> Lowering:
        """Lower on a :class:`PlacementMeshImpl` (default Mesh TF's ``b1:2;b2:2`` spatial partitioning).

        Raises:
            LayoutError: naming the tensor and dimension if the layout is illegal for this model.
        """
        return Lowering(self.graph, {self.mesh: PlacementMeshImpl(mesh_shape, layout, devices)})

    def train_fetches(self) -> list:
        """``[loss] + update_ops``: what one training step fetches."""
        return [self.loss, *self.update_ops]

    def prepare_images(self, images) -> torch.Tensor:
        """Host-side blocking of ``[k, 28, 28]`` image rows (what the ``images`` placeholder holds)."""
        return to_blocks(images, self.row_blocks, self.col_blocks)

    def feeds(self, images, labels) -> dict:
        """Feeds for one batch: images ``[batch, 28, 28]`` (uint8 scaled by 1/255) are blocked on the host."""
        return {self.images: to_blocks(images, self.row_blocks, self.col_blocks),
                self.labels: torch.as_tensor(np.asarray(labels)).to(torch.int64)}


def build_conv_model(batch_size: int = 200, seed: int = 0, hidden_size: int = 512, filters: int = 16,
                     filter_size: int = 9, learning_rate: float = 0.02, momentum: float = 0.9, warmup_steps: int = 100,
                     optimizer=None,
                     rows: int = 28, cols: int = 28, row_blocks: int = ROW_BLOCKS, col_blocks: int = COL_BLOCKS,
                     num_classes: int = NUM_CLASSES, dtype: torch.dtype = torch.float32) -> ConvMnistModel:
    """Build Mesh TF's convolutional MNIST model and its update (no layout yet: see ``make_lowering``).

    Args:
        batch_size: the ``batch`` dim.
        seed: graph seed; the initial weights depend on it only (never on the layout).
        hidden_size: size of ``hidden1`` and ``hidden2`` (Mesh TF default 512).
        filters, filter_size: filters per convolution (16) and the odd window (9).
        learning_rate, momentum: of the default :class:`MomentumOptimizer`.
        warmup_steps: the learning rate rises linearly to ``learning_rate`` over this many steps
            (a ``global_step`` variable counts them); 0 for a constant rate. Without it the first
            steps at 0.02 overshoot (the loss spikes near step 20), which also amplifies float32
            rounding differences between layouts from 1e-7 to 1e-3 within 20 steps.
        optimizer: any meshtorch optimizer with ``apply_grads(grads, variables)`` (overrides the above).
        rows, cols, row_blocks, col_blocks: image size and its block grid (28, 28, 4, 4).
        dtype: of the images, activations and variables (float32; float64 for exactness checks).

    Returns:
        :class:`ConvMnistModel`.

    Raises:
        ValueError: a non-positive size, an even filter, or an image that does not divide into blocks.
    """
    for what, v in (("batch_size", batch_size), ("hidden_size", hidden_size), ("filters", filters),
                    ("filter_size", filter_size), ("num_classes", num_classes)):
        if int(v) <= 0:
            raise ValueError(f"build_conv_model: {what} must be positive, got {v}.")
    if rows % row_blocks or cols % col_blocks:
        raise ValueError(f"build_conv_model: {rows}x{cols} images do not divide into {row_blocks}x{col_blocks} "
                         "blocks.")
    graph = Graph(seed=seed)
    mesh = Mesh(graph, "mesh")
    batch = Dimension("batch", batch_size)
    rb, cb = Dimension("row_blocks", row_blocks), Dimension("col_blocks", col_blocks)
    rs, cs = Dimension("rows_size", rows // row_blocks), Dimension("cols_size", cols // col_blocks)
    channel = Dimension("one_channel", 1)
    classes = Dimension("classes", num_classes)
    images = placeholder(mesh, "images", [batch, rb, cb, rs, cs, channel], dtype=dtype)
    labels = placeholder(mesh, "labels", [batch], dtype=torch.int64)

    k = (filter_size, filter_size)

    def he(in_name, out_name):  # He et al. 2015: normal, variance 2 / (window x in_channels)
        return VarianceScalingInitializer(2.0, "fan_in", "normal", reduced_dims=["fh", "fw", in_name],
                                          new_dims=[out_name])

    f1 = relu(conv2d_with_blocks(images, Dimension("filters1", filters), k, (1, 1), "SAME", rb, cb,
                                 filter_initializer=he("one_channel", "filters1"), name="conv0"))
    f2 = relu(conv2d_with_blocks(f1, Dimension("filters2", filters), k, (1, 1), "SAME", rb, cb,
                                 filter_initializer=he("filters1", "filters2"), name="conv1"))
    x = reduce_mean(f2, reduced_dim="filters2")
    h1 = dense(x, Dimension("hidden1", hidden_size), reduced_dims=[rb, cb, rs, cs], activation=relu, name="hidden1")
    h2 = dense(h1, Dimension("hidden2", hidden_size), activation=relu, name="hidden2")
    logits = dense(h2, classes, name="logits")
    loss = reduce_mean(softmax_cross_entropy_with_logits(logits, one_hot(labels, classes), classes), name="loss")

    variables = list(graph.trainable_variables)
    grads = gradients([loss], variables)
    update_ops = []
    if optimizer is None:
        lr = learning_rate
        if warmup_steps:
            step = get_variable(mesh, "global_step", [], initializer=0.0, dtype=dtype, trainable=False)
            lr = minimum((step + 1.0) * (learning_rate / warmup_steps), learning_rate, name="learning_rate")
            update_ops.append(assign_add(step, 1.0, name="global_step_update"))
        optimizer = MomentumOptimizer(lr, momentum)
    update_ops = optimizer.apply_grads(grads, variables) + update_ops
    return ConvMnistModel(graph, mesh, batch, classes, images, labels, logits, loss, update_ops, row_blocks,
                          col_blocks)
