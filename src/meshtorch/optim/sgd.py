"""SGD and momentum, built on the graph (Mesh TF ``mtf.optimize``; formulas of ``torch.optim.SGD``).

Slot variables (momentum) are variables with the same named shape as their parameter, so they
are laid out by the same rules and live where the parameter's slices live.
"""

from __future__ import annotations

from meshtorch.ops import elementwise as ew
from meshtorch.ops.initializers import zeros_initializer
from meshtorch.ops.variables import Assign, get_variable
from meshtorch.optim.base import Optimizer, check_grad, grouped_pairs
from meshtorch.optim.foreach_sgd import ForeachSgdGroupUpdate

__all__ = ["Optimizer", "SgdOptimizer", "MomentumOptimizer", "MeshTFMomentumOptimizer"]


def _grouped_updates(opt, grads, variables, momentum: float | None, fold: bool, slot_name):
    """One :class:`ForeachSgdGroupUpdate` per (mesh, dtype) group of the variables with a gradient, one
    assignment per variable, one step increment per mesh: ``apply_grads`` as multi-tensor steps."""
    groups = grouped_pairs(grads, variables, by_dtype=True)
    ops, meshes = [], []
    for (mesh, _), pairs in groups.items():
        with mesh.graph.storage_scope():
            gs, slots = [], []
            for g, var in pairs:
                check_grad(g, var, type(opt).__name__)
                gs.append(g if g.dtype == var.dtype else ew.cast(g, var.dtype))
                if momentum is not None:
                    slots.append(get_variable(mesh, slot_name(var), var.shape, initializer=zeros_initializer(),
                                              dtype=var.dtype, trainable=False))
            op = ForeachSgdGroupUpdate([var.value for _, var in pairs], slots, gs, opt.lr_for(pairs[0][1]),
                                       momentum=momentum, weight_decay=opt.weight_decay, fold=fold,
                                       name="sgd_group")
            n = len(pairs)
            for i, (_, var) in enumerate(pairs):
                if slots:
                    ops.append(Assign([slots[i].operation, var], [op.outputs[n + i], op.outputs[i]],
                                      name=f"{var.name}/momentum_update"))
                else:
                    ops.append(Assign([var], [op.outputs[i]], name=f"{var.name}/sgd"))
        if mesh not in meshes:
            meshes.append(mesh)
    for mesh in meshes:
        step = opt.step_int(mesh)
        ops.append(Assign([step.operation], [step + 1], name="global_step_increment"))
    return ops


class SgdOptimizer(Optimizer):
    """``g <- g + wd w; w <- w - lr g`` (``torch.optim.SGD(lr, weight_decay=wd)``).

    Args:
        learning_rate: float, scalar Tensor, or schedule ``fn(step) -> Tensor``.
        weight_decay: L2 coefficient added to the gradient (default 0).
    """

    def __init__(self, learning_rate=0.1, weight_decay=0.0):
        super().__init__(learning_rate)
        self.weight_decay = float(weight_decay)

    def apply_grads(self, grads, variables):
        """As :meth:`Optimizer.apply_grads`, as multi-tensor steps: one ``torch._foreach_*`` call per stage for
        all variables of a mesh and dtype (``torch.optim.SGD(foreach=True)``); the values of :meth:`apply_grad`."""
        grads, variables = list(grads), list(variables)
        if type(self).apply_grad is not SgdOptimizer.apply_grad or len(grads) != len(variables):
            return super().apply_grads(grads, variables)
        return _grouped_updates(self, grads, variables, None, False, None)

    def apply_grad(self, grad, var):
        check_grad(grad, var, "SgdOptimizer")
        if self.weight_decay:
            grad = grad + var.value * self.weight_decay
        return [Assign([var], [var.value - grad * self.lr_for(var)], name=f"{var.name}/sgd")]


class MomentumOptimizer(Optimizer):
    """Heavy-ball momentum as ``torch.optim.SGD(momentum=m)``: ``v <- m v + g; w <- w - lr v``.

    The momentum slot ``{var}/momentum`` is a non-trainable variable laid out like ``var``. Mesh
    TF's ``MomentumOptimizer`` (:class:`MeshTFMomentumOptimizer`, ``mtf.optimize.MomentumOptimizer``) is this
    class with the learning rate folded into ``v`` (``v <- lr g + m v; w <- w - v``) and Mesh TF's slot name:
    the two agree for a constant learning rate and differ under a schedule (Mesh TF's ``v`` keeps the
    old rates); we follow torch here so torch recipes port unchanged.

    Args:
        learning_rate: float, scalar Tensor, or schedule ``fn(step) -> Tensor``.
        momentum: the factor m.
        weight_decay: L2 coefficient added to the gradient (default 0).
    """

    #: Mesh TF's form: ``v`` holds ``lr g + m v`` (the rate folded in)
    fold_learning_rate = False

    def __init__(self, learning_rate=0.1, momentum=0.9, weight_decay=0.0):
        super().__init__(learning_rate)
        self.momentum = float(momentum)
        self.weight_decay = float(weight_decay)

    def slot_name(self, var) -> str:
        """The momentum slot variable's name."""
        return f"{var.name}/momentum"

    def apply_grads(self, grads, variables):
        """As :meth:`Optimizer.apply_grads`, as multi-tensor steps (see :meth:`SgdOptimizer.apply_grads`)."""
        grads, variables = list(grads), list(variables)
        if type(self).apply_grad is not MomentumOptimizer.apply_grad or len(grads) != len(variables):
            return super().apply_grads(grads, variables)
        return _grouped_updates(self, grads, variables, self.momentum, self.fold_learning_rate, self.slot_name)

    def apply_grad(self, grad, var):
        check_grad(grad, var, "MomentumOptimizer")
        if self.weight_decay:
            grad = grad + var.value * self.weight_decay
        v = get_variable(var.mesh, self.slot_name(var), var.shape, initializer=zeros_initializer(),
                         dtype=var.dtype, trainable=False)
        if self.fold_learning_rate:
            new_v = grad * self.lr_for(var) + v * self.momentum
            return [Assign([v.operation, var], [new_v, var.value - new_v], name=f"{var.name}/sgd_momentum")]
        new_v = v * self.momentum + grad
        return [Assign([v.operation, var], [new_v, var.value - new_v * self.lr_for(var)],
                       name=f"{var.name}/momentum_update")]


class MeshTFMomentumOptimizer(MomentumOptimizer):
    """SGD with momentum as Mesh TF computes it: ``v <- lr g + m v; w <- w - v`` (slot ``{var}_momentum_v``).

    Exported as ``mtf.optimize.MomentumOptimizer`` (Mesh TF's signature: no weight decay). The update is
    :class:`MomentumOptimizer`'s with the rate folded into ``v``: the same numbers for a constant rate.
    """

    fold_learning_rate = True

    def __init__(self, learning_rate, momentum):
        super().__init__(learning_rate, momentum)

    def slot_name(self, var) -> str:
        return f"{var.name}_momentum_v"
