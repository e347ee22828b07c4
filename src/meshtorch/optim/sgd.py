"""SGD and momentum, built on the graph (Mesh TF ``mtf.optimize``).

Slot variables (momentum) are variables with the same named shape as their parameter, so they
are laid out by the same rules and live where the parameter's slices live.
"""

from __future__ import annotations

from meshtorch.core.graph import Tensor
from meshtorch.ops.initializers import zeros_initializer
from meshtorch.ops.variables import Assign, Variable, _as_variable, get_variable


class Optimizer:
    """Base: ``apply_grads(grads, variables) -> [Assign]``; ``apply_grad`` per variable."""

    def apply_grads(self, grads, variables) -> list[Assign]:
        """One update per (gradient, variable) pair; pairs with a None gradient are skipped.

        Args:
            grads: Tensors from ``mtf.gradients`` (same named shape as each variable).
            variables: Variables or their value tensors (e.g. ``graph.trainable_variables``).

        Returns:
            list of Assign operations; fetch them in ``lowering.run`` to apply the update.

        A gradient in another dtype than the variable's slices (e.g. a bfloat16 gradient of a
        mixed-precision variable's activation-dtype read) is cast to the slice dtype first, so
        updates are applied in the variable's own precision.
        """
        from meshtorch.ops.elementwise import cast
        ops = []
        for g, v in zip(grads, variables, strict=True):
            if g is None:
                continue
            var = _as_variable(v)
            ops.extend(self.apply_grad(cast(g, var.dtype) if g.dtype != var.dtype else g, var))
        return ops

    def apply_grad(self, grad: Tensor, var: Variable) -> list[Assign]:
        raise NotImplementedError


class SgdOptimizer(Optimizer):
    """``w <- w - lr * g``.

    Args:
        learning_rate: float, or a scalar Tensor (e.g. a schedule).
    """

    def __init__(self, learning_rate=0.1):
        self.lr = learning_rate

    def apply_grad(self, grad, var):
        return [Assign([var], [var.value - grad * self.lr], name=f"{var.name}/sgd")]


class MomentumOptimizer(Optimizer):
    """Heavy-ball momentum as ``torch.optim.SGD(momentum=m)``: ``v <- m v + g; w <- w - lr v``.

    The momentum slot ``{var}/momentum`` is a non-trainable variable laid out like ``var``.
    """

    def __init__(self, learning_rate=0.1, momentum=0.9):
        self.lr = learning_rate
        self.momentum = momentum

    def apply_grad(self, grad, var):
        v = get_variable(var.mesh, f"{var.name}/momentum", var.shape, initializer=zeros_initializer(),
                         dtype=var.dtype, trainable=False)
        new_v = v * self.momentum + grad
        return [Assign([v.operation, var], [new_v, var.value - new_v * self.lr], name=f"{var.name}/momentum_update")]
