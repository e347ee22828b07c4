"""Optimizer-in-backward: each variable's update applied as soon as its gradient is final, so the gradient is
freed after its update instead of living until the end of the backward pass (PyTorch's
``register_post_accumulate_grad_hook`` optimizer-in-backward recipe; the peak of a training step then holds one
block's gradients, not all of them).

:func:`per_variable` makes an optimizer build one update op per variable (AdamW's default is one multi-tensor op
whose inputs are every gradient, which cannot run before the last gradient); :func:`mark_in_backward` marks the
update ops of a graph's updates, and the plan moves each marked update right after its gradient is final and
after the last reader of the weight (:func:`meshtorch.lowering.donate.updates_in_backward`). The values are
those of the normal step: each update reads the same gradient, weight and moments.

Not with gradient clipping (the global norm needs every gradient before any update) nor with gradient
accumulation (the optimizer runs once per N microbatches on the summed gradients).
"""

from __future__ import annotations

from meshtorch.optim.fused import UpdateOperation

__all__ = ["mark_in_backward", "per_variable"]


def per_variable(optimizer):
    """``optimizer``, set to build one update op per variable (``multi_tensor = False``); returned."""
    optimizer.multi_tensor = False
    return optimizer


def mark_in_backward(updates) -> int:
    """Mark the update ops (:class:`~meshtorch.optim.fused.UpdateOperation`) producing the new values of the
    assignments ``updates`` to run as soon as their inputs are ready; returns how many were marked.

    Raises:
        ValueError: if none is a per-variable update op (an optimizer whose update is elementwise ops or one
            multi-tensor op over every variable: build it with :func:`per_variable`).
    """
    writers: dict = {}  # update op -> the assignments of its outputs (a multi-tensor op feeds many)
    for assign in updates:
        for t in assign.inputs:
            if isinstance(t.operation, UpdateOperation):
                writers.setdefault(t.operation, set()).add(assign)
    marked = [op for op, assigns in writers.items() if len(assigns) == 1]
    for op in marked:
        op.in_backward = True
    if not marked:
        raise ValueError("optimizer-in-backward: no per-variable update op among the updates; use a fused optimizer "
                         "(AdamW, Adam, Adafactor) built with meshtorch.optim.in_backward.per_variable.")
    return len(marked)
