"""Reverse-mode differentiation on the graph: ``gradients(ys, xs)``, and ``recompute_grad`` built on it.

The gradient is built from ordinary graph operations (each op's ``gradient()``), so the backward
pass is laid out by the same rules as the forward pass and lowered like everything else
(Mesh TF ``mtf.gradients``). ``recompute_grad`` (Mesh TF ``mtf.recompute_grad``) is a
``custom_gradient`` whose gradient function calls ``gradients``, so it sits here, above the ops.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Sequence

from meshtorch.core.graph import Operation, Tensor
from meshtorch.ops.binary import add
from meshtorch.ops.control import WhileLoopOperation, custom_gradient
from meshtorch.ops.elementwise import identity
from meshtorch.ops.variables import ones

__all__ = ["gradients", "recompute_grad"]


def _as_tensor(x) -> Tensor:
    if isinstance(x, Tensor):
        return x
    if isinstance(x, Operation) and x.outputs:
        return x.outputs[0]
    raise TypeError(f"gradients: expected an mtf Tensor or Variable, got {x!r}.")


def gradients(ys, xs, grad_ys=None, operations=None) -> list[Tensor | None]:
    """d(sum of ys)/d(x) for each x, as graph Tensors with x's shape (None if x does not affect ys).

    Args:
        ys: Tensor or list of Tensors (usually one scalar loss).
        xs: Tensors or Variables (their value tensors are used).
        grad_ys: optional upstream gradients, one per y (default: ones of y's shape).
        operations: Mesh TF's optional list of the graph's operations to walk; accepted and ignored
            (the walk always starts from ``ys``, which gives the same gradients).

    Returns:
        list of Tensors (same named shape and dtype as each x) or None.
    """
    ys = [ys] if isinstance(ys, Tensor) else list(ys)
    xs = [_as_tensor(x) for x in xs]
    if not ys:
        raise ValueError("gradients: ys is empty.")
    graph = ys[0].graph
    ops = list(graph.operations)
    first_new = len(ops)
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
    for op in graph.operations[first_new:]:
        op.backward = True  # the backward pass (FSDP re-gathers the weights it reads; see MeshImpl)
    return [grads.get(x) for x in xs]


def _lower_kept(op: Operation, originals: list, lw):
    """Lowering of a kept clone ``op`` (``recompute_grad(keep=...)``): its outputs are the forward pass's
    values ``originals``."""
    for new, old in zip(op.outputs, originals, strict=True):
        lw.set(new, lw.get(old))


def _clone_operations(ops: Sequence[Operation], mapping: dict, keep: Callable | None = None) -> None:
    """Append a copy of each op (in order) reading ``mapping``'s tensors; map old outputs to new ones.

    A clone keeps its original's name, so anything keyed by the op name (the counter-based random
    ops) produces exactly the same values when recomputed. An op with ``keep(op)`` true is not
    recomputed: its clone (whose gradient rule is the original's, on the recomputed inputs) lowers to
    the forward pass's output values, which therefore stay alive until the backward pass.
    """
    for op in ops:
        if isinstance(op, WhileLoopOperation):
            raise NotImplementedError(f"recompute_grad: cannot recompute while_loop {op.name!r}; "
                                      "keep loops outside fn.")
        new = copy.copy(op)
        new.inputs = [mapping.get(t, t) for t in op.inputs]
        new.outputs = [Tensor(new, t.shape, t.dtype, index=t.index, name=t.name) for t in op.outputs]
        if keep is not None and keep(op):
            new.lower = functools.partial(_lower_kept, new, list(op.outputs))
        op.graph.operations.append(new)
        mapping.update(zip(op.outputs, new.outputs, strict=True))


def _recompute_grad_fn(explicit_inputs, all_inputs, forward_operations, outputs, output_grads, keep=None):
    if all(g is None for g in output_grads):
        return [None] * len(all_inputs)
    # differentiate w.r.t. fresh copies of the inputs, so that no gradient leaks from one input to
    # another through the ops that computed them (the outer backward pass handles those)
    proxies = [identity(t, name="recompute_input") for t in all_inputs]
    mapping = dict(zip(all_inputs, proxies, strict=True))
    _clone_operations(forward_operations, mapping, keep)
    pairs = [(mapping[y], g) for y, g in zip(outputs, output_grads, strict=True) if g is not None]
    return gradients([y for y, _ in pairs], proxies, [g for _, g in pairs])


def recompute_grad(fn: Callable, explicit_inputs, control_dependencies=True,
                   keep: Callable[[Operation], bool] | None = None) -> Tensor | list[Tensor]:
    """``fn(*explicit_inputs)``, recomputed in the backward pass instead of kept (Mesh TF ``mtf.recompute_grad``).

    Activation checkpointing: the backward pass rebuilds ``fn``'s forward operations from the inputs
    (clones appended to the graph when the gradient is built, hence lowered in the backward part of
    the program) and differentiates the copies, so the forward intermediates die right after the
    forward pass. Gradients reach the explicit inputs and every tensor ``fn`` reads (variables).
    Clones keep their op names, so random ops keyed by op name (and seed) draw identical values.

    ``control_dependencies`` (Mesh TF: whether the recomputation waits for the backward pass) is accepted and ignored:
    a meshtorch program runs its steps in order, so the recomputation already follows them.

    ``keep`` (ours; PyTorch's selective activation checkpointing policies): ops ``fn`` builds for which
    ``keep(op)`` is true are not recomputed; their forward outputs are kept for the backward pass
    (e.g. keep matmul outputs, recompute the cheap elementwise ops).

    Returns:
        what ``fn`` returns. Raises NotImplementedError if ``fn`` contains a while_loop.
    """
    grad_fn = _recompute_grad_fn if keep is None else functools.partial(_recompute_grad_fn, keep=keep)
    return custom_gradient(fn, grad_fn, explicit_inputs)
