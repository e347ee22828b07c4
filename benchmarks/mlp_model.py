"""The MNIST MLP of Mesh TF's README as a meshtorch graph, with synthetic data (used by the SPMD benchmarks).

``images [batch, r:28, c:28] -> relu(einsum with w1 [r, c, hidden]) -> einsum with w2 [hidden, classes:10]``,
softmax cross entropy, plain SGD. Example ``i`` of the synthetic data set is a fixed function of ``i``, so a
process can make only the examples of its batch slice.
"""

from __future__ import annotations

import resource

import torch

import meshtorch as mtf
from meshtorch.layers.core import softmax_cross_entropy_with_logits


def build(hidden: int, batch: int, lr: float = 0.1, seed: int = 0):
    """Returns ``(graph, mesh, images, labels, loss, update_ops, w1, w2)``."""
    g = mtf.Graph(seed=seed)
    mesh = mtf.Mesh(g, "mesh")
    b, r, c = mtf.Dimension("batch", batch), mtf.Dimension("r", 28), mtf.Dimension("c", 28)
    h, k = mtf.Dimension("hidden", hidden), mtf.Dimension("classes", 10)
    images = mtf.placeholder(mesh, "images", [b, r, c])
    labels = mtf.placeholder(mesh, "labels", [b], dtype=torch.int64)
    w1 = mtf.get_variable(mesh, "w1", [r, c, h])
    w2 = mtf.get_variable(mesh, "w2", [h, k])
    hid = mtf.relu(mtf.einsum([images, w1], output_shape=[b, h]))
    logits = mtf.einsum([hid, w2], output_shape=[b, k])
    loss = mtf.reduce_mean(softmax_cross_entropy_with_logits(logits, mtf.one_hot(labels, k), k))
    grads = mtf.gradients([loss], [w1, w2])
    update = mtf.optim.SgdOptimizer(lr).apply_grads(grads, [w1, w2])
    return g, mesh, images, labels, loss, update, w1, w2


def examples(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic (images [n, 28, 28] float32 in [0, 1), labels [n] int64) for example ids."""
    ids = ids.to(torch.int64)
    pix = torch.arange(28 * 28, dtype=torch.int64)
    h = (ids[:, None] * 2654435761 + pix[None, :] * 40503) % 1000003
    images = (h.to(torch.float32) / 1000003.0).reshape(-1, 28, 28)
    return images, (ids * 7 + 3) % 10


def max_rss_mib() -> float:
    """Peak resident set size of this process so far (MiB; Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def current_rss_mib() -> float:
    """Resident set size now (MiB), from /proc/self/statm (Linux)."""
    import os

    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / (1024.0 * 1024.0)
