"""Mesh TF programs ported by changing one import (issue 15, item 3).

The two models below are written as Mesh TensorFlow 0.1.21's users write them: the README's MNIST
snippet and ``examples/mnist.py``'s ``mnist_model`` + ``model_fn`` training step. The changes are the
import line (``import meshtorch as mtf`` for ``import mesh_tensorflow as mtf``) and the TensorFlow input
plumbing (a torch tensor for ``tf_images``; ``lowering.run`` for ``lowering.lowered_operation`` /
``export_to_tf_tensor`` and the Estimator), marked ``# TF plumbing``. Each trains on Fashion-MNIST
under Mesh TF's own layouts, and gives the same losses as on one processor.
"""

from __future__ import annotations

import torch

import meshtorch as mtf  # was: import mesh_tensorflow as mtf
from meshtorch.data.mnist import load_mnist  # TF plumbing: the input pipeline
from meshtorch.testing import rel_error


def _batches(batch_size, steps):
    images, labels = load_mnist("train")  # TF plumbing
    images = images[: batch_size * steps].to(torch.float32) / 255.0
    return [(images[i * batch_size:(i + 1) * batch_size], labels[i * batch_size:(i + 1) * batch_size])
            for i in range(steps)]


def readme_snippet(tf_images, tf_labels):
    """Mesh TF README, "A simple example", verbatim but for ``mtf.einsum([images, w1], ...)``: the README
    passes ``mtf.einsum(images, w1, output_shape=...)``, which Mesh TF 0.1.21 itself rejects (``einsum``
    takes a list), and the placeholders that feed its TF tensors."""
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "my_mesh")
    batch_dim = mtf.Dimension("batch", 100)
    rows_dim = mtf.Dimension("rows", 28)
    cols_dim = mtf.Dimension("cols", 28)
    hidden_dim = mtf.Dimension("hidden", 1024)
    classes_dim = mtf.Dimension("classes", 10)
    images = mtf.placeholder(mesh, "images", shape=[batch_dim, rows_dim, cols_dim])  # TF plumbing (fed)
    labels = mtf.placeholder(mesh, "labels", [batch_dim], dtype=torch.int64)  # TF plumbing (fed)
    w1 = mtf.get_variable(mesh, "w1", [rows_dim, cols_dim, hidden_dim])
    w2 = mtf.get_variable(mesh, "w2", [hidden_dim, classes_dim])
    # einsum is a generalization of matrix multiplication (see numpy.einsum)
    hidden = mtf.relu(mtf.einsum([images, w1], output_shape=[batch_dim, hidden_dim]))
    logits = mtf.einsum([hidden, w2], output_shape=[batch_dim, classes_dim])
    loss = mtf.reduce_mean(mtf.layers.softmax_cross_entropy_with_logits(
        logits, mtf.one_hot(labels, classes_dim), classes_dim))
    w1_grad, w2_grad = mtf.gradients([loss], [w1, w2])
    update_w1_op = mtf.assign(w1, w1 - w1_grad * 0.001)
    update_w2_op = mtf.assign(w2, w2 - w2_grad * 0.001)
    return graph, mesh, images, labels, loss, [update_w1_op, update_w2_op]


def _train_readme(mesh_shape, layout_rules, devices, steps=8):
    graph, mesh, images, labels, loss, updates = readme_snippet(None, None)
    mesh_impl = mtf.placement_mesh_impl.PlacementMeshImpl(mesh_shape, layout_rules, devices)
    lowering = mtf.Lowering(graph, {mesh: mesh_impl})
    losses = []
    for x, y in _batches(100, steps):  # TF plumbing: lowering.run instead of tf.Session.run
        losses.append(lowering.run([loss] + updates, feeds={images: x, labels: y})[0].item())
    return losses


def test_readme_snippet_trains_under_its_layouts():
    one = _train_readme([], [], [""])
    data = _train_readme([("all_processors", 4)], [("batch", "all_processors")], ["cpu"] * 4)
    model = _train_readme([("processor_rows", 2), ("processor_cols", 2)],
                          [("batch", "processor_rows"), ("hidden", "processor_cols")], ["cpu"] * 4)
    assert one[-1] < one[0]  # SGD at lr 0.001 lowers the loss
    for other in (data, model):
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(other, one, strict=True)), (other, one)


class FLAGS:  # examples/mnist.py's tf.flags, smaller for a test
    batch_size = 20
    hidden_size = 32
    mesh_shape = "b1:2;b2:2"
    layout = "row_blocks:b1;col_blocks:b2"


def mnist_model(image, labels, mesh):
    """``examples/mnist.py``'s model (mesh-tensorflow 0.1.21), unchanged but for ``image``/``labels`` being
    torch tensors imported with ``mtf.import_tf_tensor`` (``tf.reshape`` -> ``.reshape``: TF plumbing)."""
    batch_dim = mtf.Dimension("batch", FLAGS.batch_size)
    row_blocks_dim = mtf.Dimension("row_blocks", 4)
    col_blocks_dim = mtf.Dimension("col_blocks", 4)
    rows_dim = mtf.Dimension("rows_size", 7)
    cols_dim = mtf.Dimension("cols_size", 7)

    classes_dim = mtf.Dimension("classes", 10)
    one_channel_dim = mtf.Dimension("one_channel", 1)

    x = mtf.import_tf_tensor(
        mesh, image.reshape([FLAGS.batch_size, 4, 7, 4, 7, 1]),  # TF plumbing: tf.reshape(image, ...)
        mtf.Shape(
            [batch_dim, row_blocks_dim, rows_dim,
             col_blocks_dim, cols_dim, one_channel_dim]))
    x = mtf.transpose(x, [
        batch_dim, row_blocks_dim, col_blocks_dim,
        rows_dim, cols_dim, one_channel_dim])

    # add some convolutional layers to demonstrate that convolution works.
    filters1_dim = mtf.Dimension("filters1", 16)
    filters2_dim = mtf.Dimension("filters2", 16)
    f1 = mtf.relu(mtf.layers.conv2d_with_blocks(
        x, filters1_dim, filter_size=[9, 9], strides=[1, 1], padding="SAME",
        h_blocks_dim=row_blocks_dim, w_blocks_dim=col_blocks_dim, name="conv0"))
    f2 = mtf.relu(mtf.layers.conv2d_with_blocks(
        f1, filters2_dim, filter_size=[9, 9], strides=[1, 1], padding="SAME",
        h_blocks_dim=row_blocks_dim, w_blocks_dim=col_blocks_dim, name="conv1"))
    x = mtf.reduce_mean(f2, reduced_dim=filters2_dim)

    # add some fully-connected dense layers.
    hidden_dim1 = mtf.Dimension("hidden1", FLAGS.hidden_size)
    hidden_dim2 = mtf.Dimension("hidden2", FLAGS.hidden_size)

    h1 = mtf.layers.dense(
        x, hidden_dim1,
        reduced_dims=x.shape.dims[-4:],
        activation=mtf.relu, name="hidden1")
    h2 = mtf.layers.dense(
        h1, hidden_dim2,
        activation=mtf.relu, name="hidden2")
    logits = mtf.layers.dense(h2, classes_dim, name="logits")
    if labels is None:
        loss = None
    else:
        labels = mtf.import_tf_tensor(
            mesh, labels.reshape([FLAGS.batch_size]), mtf.Shape([batch_dim]))  # TF plumbing
        loss = mtf.layers.softmax_cross_entropy_with_logits(
            logits, mtf.one_hot(labels, classes_dim), classes_dim)
        loss = mtf.reduce_mean(loss)
    return logits, loss


def model_fn_train_step(features, labels, mesh_shape_flag, layout_flag):
    """The TRAIN branch of ``examples/mnist.py``'s ``model_fn`` up to the lowering (the Estimator, hooks and
    savers are TF plumbing)."""
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "my_mesh")
    logits, loss = mnist_model(features, labels, mesh)
    mesh_shape = mtf.convert_to_shape(mesh_shape_flag)
    layout_rules = mtf.convert_to_layout_rules(layout_flag)
    mesh_size = mesh_shape.size
    mesh_devices = [""] * mesh_size
    mesh_impl = mtf.placement_mesh_impl.PlacementMeshImpl(
        mesh_shape, layout_rules, mesh_devices)

    var_grads = mtf.gradients(
        [loss], [v.outputs[0] for v in graph.trainable_variables])
    optimizer = mtf.optimize.AdafactorOptimizer()
    update_ops = optimizer.apply_grads(var_grads, graph.trainable_variables)

    lowering = mtf.Lowering(graph, {mesh: mesh_impl})
    return lowering, loss, update_ops


def _train_mnist_example(mesh_shape, layout, steps=4):
    losses = []
    values = None
    for x, y in _batches(FLAGS.batch_size, steps):
        # the example imports each batch as a constant (import_tf_tensor): one graph per batch, as the
        # Estimator builds one per input; the variables carry over through their values
        lowering, loss, update_ops = model_fn_train_step(x, y, mesh_shape, layout)
        if values is not None:
            for name, v in values.items():
                lowering.set_variable_value(name, v)
        losses.append(lowering.run([loss] + update_ops)[0].item())
        values = {n: lowering.variable_value(n) for n in lowering.variable_names}
    return losses, values


def test_examples_mnist_model_trains_on_its_spatially_partitioned_layout():
    part, part_vars = _train_mnist_example(FLAGS.mesh_shape, FLAGS.layout)
    one, one_vars = _train_mnist_example("", "")
    assert all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(part, one, strict=True)), (part, one)
    assert all(rel_error(part_vars[n], one_vars[n]) <= 1e-4 for n in one_vars)
    assert one[-1] < one[0]  # Adafactor lowers the loss on Fashion-MNIST
    assert sorted(one_vars) == sorted(part_vars) and "conv0/kernel" in one_vars
