"""Reverse-mode differentiation on the graph: ``gradients(ys, xs)``.

The gradient is built from ordinary graph operations (each op's ``gradient()``), so the backward
pass is laid out by the same rules as the forward pass and lowered like everything else
(Mesh TF ``mtf.gradients``).
"""

from __future__ import annotations

from meshtorch.core.graph import Operation, Tensor


def _as_tensor(x) -> Tensor:
    if isinstance(x, Tensor):
        return x
    if isinstance(x, Operation) and x.outputs:
        return x.outputs[0]
    raise TypeError(f"gradients: expected an mtf Tensor or Variable, got {x!r}.")


def gradients(ys, xs, grad_ys=None) -> list[Tensor | None]:
    """d(sum of ys)/d(x) for each x, as graph Tensors with x's shape (None if x does not affect ys).

    Args:
        ys: Tensor or list of Tensors (usually one scalar loss).
        xs: Tensors or Variables (their value tensors are used).
        grad_ys: optional upstream gradients, one per y (default: ones of y's shape).

    Returns:
        list of Tensors (same named shape and dtype as each x) or None.
    """
    ys = [ys] if isinstance(ys, Tensor) else list(ys)
    xs = [_as_tensor(x) for x in xs]
    if not ys:
        raise ValueError("gradients: ys is empty.")
    graph = ys[0].graph
    from meshtorch.ops.binary import add
    from meshtorch.ops.variables import ones

    ops = list(graph.operations)
    # tensors downstream of xs
    downstream = set(xs)
    for op in ops:
        if any(t in downstream for t in op.inputs):
            downstream.update(op.outputs)
    # ops upstream of ys that touch downstream tensors
    upstream = set(ys)
    relevant = []
    for op in reversed(ops):
        if any(t in upstream for t in op.outputs):
            upstream.update(op.inputs)
            if any(t in downstream for t in op.inputs) and op.has_gradient:
                relevant.append(op)
    grads: dict[Tensor, Tensor] = {}
    grad_ys = grad_ys if grad_ys is not None else [None] * len(ys)
    for y, g in zip(ys, grad_ys, strict=True):
        g = g if g is not None else ones(y.mesh, y.shape, y.dtype, name=f"{y.operation.name}_grad_seed")
        grads[y] = add(grads[y], g) if y in grads else g
    for op in relevant:  # already in reverse topological order
        out_grads = [grads.get(t) for t in op.outputs]
        if all(g is None for g in out_grads):
            continue
        if getattr(op, "storage_side", False):  # a variable's read cast: its gradient is taken on the shards too
            with graph.storage_scope():
                in_grads = op.gradient(out_grads)
        else:
            in_grads = op.gradient(out_grads)
        for t, g in zip(op.inputs, in_grads, strict=True):
            if g is None or t not in downstream:
                continue
            grads[t] = add(grads[t], g) if t in grads else g
    return [grads.get(x) for x in xs]
