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
(``torch.optim.SGD`` semantics) with a linear warmup (Mesh TF uses Adafactor) unless another is
passed; the filters start He-normal (variance 2 / (81 x in_channels); Mesh TF: TF's Glorot-uniform
default), which lets plain momentum SGD train the ReLU convolutions from the first steps; pixels
may be standardized (``input_mean`` / ``input_std``, see :func:`pixel_stats`); ``activation="gelu"``
swaps every ReLU for GELU.

:func:`torch_reference` builds the same network in plain PyTorch (``torch.nn.functional.conv2d``
on whole images) with the same weights: the independent reference of the tests and of
``benchmarks/mnist_conv.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from meshtorch.autodiff import gradients
from meshtorch.core.dims import Dimension
from meshtorch.core.graph import Graph, Mesh, Operation, Tensor
from meshtorch.layers.conv import conv2d_with_blocks
from meshtorch.layers.core import dense, softmax_cross_entropy_with_logits
from meshtorch.lowering import Lowering
from meshtorch.models.mnist import simulated_spec
from meshtorch.ops.elementwise import gelu, relu
from meshtorch.ops.indexing import one_hot
from meshtorch.ops.initializers import VarianceScalingInitializer
from meshtorch.ops.reduce import reduce_mean
from meshtorch.ops.variables import placeholder
from meshtorch.optim.clip import clip_by_global_norm
from meshtorch.optim.schedules import linear_warmup
from meshtorch.optim.sgd import MomentumOptimizer

__all__ = ["ConvMnistModel", "build_conv_model", "to_blocks", "pixel_stats", "torch_reference",
           "DEFAULT_MESH", "DEFAULT_LAYOUT"]

DEFAULT_MESH = "b1:2;b2:2"
DEFAULT_LAYOUT = "row_blocks:b1;col_blocks:b2"
ROW_BLOCKS = COL_BLOCKS = 4
NUM_CLASSES = 10
ACTIVATIONS = {"relu": relu, "gelu": gelu}


def pixel_stats(images) -> tuple[float, float]:
    """Mean and standard deviation (float64 sums) of ``images`` scaled to ``[0, 1]``.

    ``images``: uint8 ``[N, H, W]`` (scaled by 1/255) or float already in ``[0, 1]``. For the
    Fashion-MNIST training set: 0.2860, 0.3530. Pass them as ``build_conv_model(input_mean=...,
    input_std=...)`` (torchvision ``Normalize`` semantics); the std is the sample std (``n - 1``).

    Raises:
        ValueError: fewer than two pixels (no standard deviation).
    """
    x = torch.as_tensor(np.asarray(images)) if not isinstance(images, torch.Tensor) else images
    if x.numel() < 2:
        raise ValueError(f"pixel_stats: need at least two pixels, got images of shape {tuple(x.shape)}.")
    if x.dtype == torch.uint8:  # a histogram of the 256 values: exact, no float copy of the data set
        counts = torch.bincount(x.reshape(-1), minlength=256).to(torch.float64)
        values = torch.arange(256, dtype=torch.float64) / 255.0
        n = counts.sum()
        mean = (counts * values).sum() / n
        return float(mean), float(((counts * (values - mean) ** 2).sum() / (n - 1)).sqrt())
    x = x.reshape(-1).to(torch.float64)
    return float(x.mean()), float(x.std())


def to_blocks(images, row_blocks: int = ROW_BLOCKS, col_blocks: int = COL_BLOCKS, mean: float = 0.0,
              std: float = 1.0) -> torch.Tensor:
    """``[batch, H, W]`` images -> ``[batch, row_blocks, col_blocks, H / row_blocks, W / col_blocks, 1]`` float32.

    Block ``(i, j)`` holds rows ``i*rs .. i*rs+rs-1`` and columns ``j*cs .. j*cs+cs-1``; uint8 pixels
    are scaled by 1/255, then standardized as ``(x - mean) / std`` (torchvision ``Normalize``).
    Raises ValueError if H or W does not divide by the number of blocks.
    """
    x = torch.as_tensor(np.asarray(images)) if not isinstance(images, torch.Tensor) else images
    if x.ndim != 3:
        raise ValueError(f"to_blocks: expected images [batch, rows, cols], got shape {list(x.shape)}.")
    b, h, w = x.shape
    if h % row_blocks or w % col_blocks:
        raise ValueError(f"to_blocks: image {h}x{w} does not divide into {row_blocks}x{col_blocks} blocks.")
    x = x.to(torch.float32) / 255.0 if x.dtype == torch.uint8 else x.to(torch.float32)
    if mean != 0.0 or std != 1.0:
        x = (x - float(mean)) / float(std)
    x = x.reshape(b, row_blocks, h // row_blocks, col_blocks, w // col_blocks).permute(0, 1, 3, 2, 4)
    return x.unsqueeze(-1).contiguous()


@dataclass
class ConvMnistModel:
    """The built graph and its handles.

    Attributes:
        graph, mesh: the Graph and its Mesh.
        images: placeholder ``[batch, row_blocks, col_blocks, rows_size, cols_size, one_channel]``
            of the model's dtype (feed :func:`to_blocks` of the images, or use :meth:`feeds`).
        labels: placeholder ``[batch]`` int64.
        logits: ``[batch, classes]``; loss: scalar mean cross-entropy.
        update_ops: optimizer Assign operations; fetch them with ``loss`` to train one step.
        row_blocks, col_blocks, input_mean, input_std, activation: as given to :func:`build_conv_model`.
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
    input_mean: float = 0.0
    input_std: float = 1.0
    activation: str = "relu"

    def make_lowering(self, mesh_shape=DEFAULT_MESH, layout=DEFAULT_LAYOUT, devices=None, mesh_impl=None) -> Lowering:
        """Lower on ``mesh_impl`` (any :class:`~meshtorch.mesh.base.MeshImpl` or
        :class:`~meshtorch.core.mesh_spec.MeshSpec`) or, for convenience, on ``MeshSpec(mesh_shape, layout)``
        (default Mesh TF's ``b1:2;b2:2`` spatial partitioning).

        Raises:
            LayoutError: naming the tensor and dimension if the layout is illegal for this model.
            ValueError: if ``devices`` is given (pass ``mesh_impl=PlacementMeshImpl(..., devices=...)``).
        """
        impl = mesh_impl if mesh_impl is not None else simulated_spec(mesh_shape, layout, devices)
        return Lowering(self.graph, {self.mesh: impl})

    def train_fetches(self) -> list:
        """``[loss] + update_ops``: what one training step fetches."""
        return [self.loss, *self.update_ops]

    def prepare_images(self, images) -> torch.Tensor:
        """Host-side blocking of ``[k, 28, 28]`` image rows (what the ``images`` placeholder holds)."""
        x = to_blocks(images, self.row_blocks, self.col_blocks, self.input_mean, self.input_std)
        return x.to(self.images.dtype)

    def feeds(self, images, labels) -> dict:
        """Feeds for one batch: images ``[batch, 28, 28]`` (uint8 scaled by 1/255) are standardized and blocked."""
        return {self.images: self.prepare_images(images),
                self.labels: torch.as_tensor(np.asarray(labels)).to(torch.int64)}


def build_conv_model(batch_size: int = 200, seed: int = 0, hidden_size: int = 512, filters: int = 16,
                     filter_size: int = 9, learning_rate: float = 0.01, momentum: float = 0.9, warmup_steps: int = 100,
                     optimizer=None, clip_norm: float | None = None, activation: str = "relu",
                     input_mean: float = 0.0, input_std: float = 1.0,
                     rows: int = 28, cols: int = 28, row_blocks: int = ROW_BLOCKS, col_blocks: int = COL_BLOCKS,
                     num_classes: int = NUM_CLASSES, dtype: torch.dtype = torch.float32) -> ConvMnistModel:
    """Build Mesh TF's convolutional MNIST model and its update (no layout yet: see ``make_lowering``).

    Args:
        batch_size: the ``batch`` dim.
        seed: graph seed; the initial weights depend on it only (never on the layout).
        hidden_size: size of ``hidden1`` and ``hidden2`` (Mesh TF default 512).
        filters, filter_size: filters per convolution (16) and the odd window (9).
        learning_rate, momentum: of the default :class:`MomentumOptimizer`.
        warmup_steps: the learning rate of step ``t`` (from 0) is ``learning_rate * min(1, (t + 1) /
            warmup_steps)`` (the optimizer's ``global_step`` counts); 0 for a constant rate. Without
            it the first steps overshoot (at 0.02 the loss spikes near step 20).
        optimizer: any meshtorch optimizer with ``apply_grads(grads, variables)`` (overrides the above).
        activation: ``"relu"`` (Mesh TF) or ``"gelu"`` (erf form) after both convolutions and both
            hidden layers. Float32 training with ReLU is chaotic: layouts sum partial results in
            different orders, so a pre-activation within rounding (~1e-7) of 0 can fall on different
            sides of the kink, which switches that unit's gradient on or off; after some 40 steps
            (default settings) the runs are two different, equally good trajectories whose step
            losses differ by a few percent, as do two single-processor runs with different
            summation orders (meshtorch vs :func:`torch_reference`). GELU's derivative is
            continuous: the float32 layouts then stay within 1e-6 for whole runs. Measured in
            ``benchmarks/mnist_conv_results.md``.
        input_mean, input_std: images are fed as ``(pixel / 255 - input_mean) / input_std``
            (``feeds`` / ``prepare_images``); :func:`pixel_stats` of the training set (Fashion-MNIST
            0.2860 / 0.3530) speeds training up markedly.
        clip_norm: if set, gradients are scaled to this global 2-norm at most before the update
            (:func:`meshtorch.optim.clip_by_global_norm`, one 4-byte all-reduce).
        rows, cols, row_blocks, col_blocks: image size and its block grid (28, 28, 4, 4).
        dtype: of the images, activations and variables (float32; float64 for exactness checks).

    Returns:
        :class:`ConvMnistModel`.

    Raises:
        ValueError: an unknown activation, a non-positive size or ``input_std``, an even filter, or an
            image that does not divide into blocks.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"build_conv_model: activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}.")
    if not input_std > 0:
        raise ValueError(f"build_conv_model: input_std must be > 0, got {input_std}.")
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

    act = ACTIVATIONS[activation]
    f1 = act(conv2d_with_blocks(images, Dimension("filters1", filters), k, (1, 1), "SAME", rb, cb,
                                filter_initializer=he("one_channel", "filters1"), name="conv0"))
    f2 = act(conv2d_with_blocks(f1, Dimension("filters2", filters), k, (1, 1), "SAME", rb, cb,
                                filter_initializer=he("filters1", "filters2"), name="conv1"))
    x = reduce_mean(f2, reduced_dim="filters2")
    h1 = dense(x, Dimension("hidden1", hidden_size), reduced_dims=[rb, cb, rs, cs], activation=act, name="hidden1")
    h2 = dense(h1, Dimension("hidden2", hidden_size), activation=act, name="hidden2")
    logits = dense(h2, classes, name="logits")
    loss = reduce_mean(softmax_cross_entropy_with_logits(logits, one_hot(labels, classes), classes), name="loss")

    variables = list(graph.trainable_variables)
    grads = gradients([loss], variables)
    if clip_norm is not None:
        grads, _ = clip_by_global_norm(grads, clip_norm)
    if optimizer is None:
        lr = learning_rate
        if warmup_steps:  # the optimizer's int64 global_step counts updates; step 0 already gets lr / warmup
            lr = lambda step: linear_warmup(step + 1.0, warmup_steps, learning_rate)  # noqa: E731
        optimizer = MomentumOptimizer(lr, momentum)
    update_ops = optimizer.apply_grads(grads, variables)
    return ConvMnistModel(graph, mesh, batch, classes, images, labels, logits, loss, update_ops, row_blocks,
                          col_blocks, float(input_mean), float(input_std), activation)


class _TorchConvMnist(nn.Module):
    """See :func:`torch_reference`."""

    def __init__(self, weights: dict, model: ConvMnistModel):
        super().__init__()
        self.params = nn.ParameterDict({k.replace("/", "_"): nn.Parameter(v.detach().clone())
                                        for k, v in weights.items()})
        self.mean, self.std, self.activation = model.input_mean, model.input_std, model.activation
        self.row_blocks, self.col_blocks = model.row_blocks, model.col_blocks

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        p = self.params
        act = F.relu if self.activation == "relu" else F.gelu
        x = images.to(torch.float32) / 255.0 if images.dtype == torch.uint8 else images.to(torch.float32)
        x = ((x - self.mean) / self.std).to(p["conv0_kernel"].dtype)[:, None]  # [batch, 1, H, W]
        for name in ("conv0", "conv1"):  # kernel [fh, fw, in, out] -> [out, in, fh, fw]; SAME = pad k // 2
            k = p[f"{name}_kernel"]
            x = act(F.conv2d(x, k.permute(3, 2, 0, 1), padding=k.shape[0] // 2))
        x = x.mean(1)  # over filters2: [batch, H, W]
        b, h, w = x.shape
        rb, cb = self.row_blocks, self.col_blocks
        x = x.reshape(b, rb, h // rb, cb, w // cb).permute(0, 1, 3, 2, 4)  # [batch, rb, cb, rows, cols]
        x = act(torch.einsum("brcij,rcijh->bh", x, p["hidden1_kernel"]) + p["hidden1_bias"])
        x = act(x @ p["hidden2_kernel"] + p["hidden2_bias"])
        return x @ p["logits_kernel"] + p["logits_bias"]


def torch_reference(model: ConvMnistModel, lowering: Lowering) -> nn.Module:
    """The same network in plain PyTorch, holding copies of ``lowering``'s current weights.

    Convolutions run on whole ``[batch, 1, 28, 28]`` images (``F.conv2d``, ``padding=4``): no blocks,
    no halos. ``module(images)`` takes images ``[batch, H, W]`` (uint8, scaled by 1/255, or float in
    ``[0, 1]``), standardizes them with the model's ``input_mean`` / ``input_std`` and returns
    logits ``[batch, classes]`` in the variables' dtype. Parameters are named like the meshtorch
    variables with ``/`` -> ``_`` (``params["conv0_kernel"]`` ``[fh, fw, in, out]``, ...), so
    ``torch.optim.SGD(module.parameters(), lr, momentum=0.9)`` trains it as the model's default
    optimizer does. Used as the independent reference of ``tests/test_mnist_conv.py`` and
    ``benchmarks/mnist_conv.py``.
    """
    weights = {v.name: lowering.variable_value(v.name) for v in model.graph.trainable_variables}
    return _TorchConvMnist(weights, model)
