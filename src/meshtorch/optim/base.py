"""Optimizer base class, the global step counter and scalar hyperparameters.

An optimizer is a graph builder: ``apply_grads(grads, variables)`` adds operations computing the
new values of the variables and of their slots (non-trainable variables with the parameter's named
shape, hence its layout) and returns the :class:`~meshtorch.ops.variables.Assign` operations to
fetch. It also returns one assignment incrementing the ``global_step`` variable, so schedules and
bias corrections see how many updates came before.

Step convention (Mesh TF, verified against ``mesh_tensorflow/optimize.py``): within a run the
step a hyperparameter sees is the value of ``global_step`` *before* the increment, i.e. 0 at the
first update (Mesh TF's ``step_num()`` = ``tf.train.get_or_create_global_step()`` read in the same
session step that increments it). Adam's bias correction uses ``t = step + 1`` as torch does.
"""

from __future__ import annotations

import functools

import torch

from meshtorch.core.graph import Mesh, Tensor
from meshtorch.core.scopes import VariableScope, variable_scope
from meshtorch.ops import elementwise as ew
from meshtorch.ops.initializers import zeros_initializer
from meshtorch.ops.variables import Assign, Variable, _as_variable, constant, get_variable

GLOBAL_STEP_NAME = "global_step"


def get_or_create_global_step(mesh: Mesh) -> Tensor:
    """The graph's step counter: a replicated int64 scalar variable ``global_step`` (starts at 0).

    Like ``tf.train.get_or_create_global_step``: the first call creates it (non-trainable, so
    gradients are never asked of it; checkpointed like any variable), later calls return it. On a
    graph with several meshes, each further mesh gets ``{mesh.name}/global_step``.

    Returns:
        the variable's value Tensor, shape ``[]``, dtype ``torch.int64``.

    Raises:
        TypeError: if a variable named ``global_step`` exists with another shape or dtype.
    """
    for name in (GLOBAL_STEP_NAME, f"{mesh.name}/{GLOBAL_STEP_NAME}"):
        for v in mesh.graph.all_variables:
            if v.name == name and v.mesh is mesh:
                if v.shape.ndims != 0 or v.dtype not in (torch.int64, torch.int32, torch.float32):
                    raise TypeError(f"global step: variable {name!r} exists with shape {v.shape} and dtype {v.dtype};"
                                    " it must be a scalar (shape []) of dtype int64, int32 or float32.")
                return v.value
    name = GLOBAL_STEP_NAME if not mesh.graph.name_in_use(GLOBAL_STEP_NAME) else f"{mesh.name}/{GLOBAL_STEP_NAME}"
    with variable_scope(VariableScope("")):  # unscoped, like TF's global step, wherever apply_grads is called
        return get_variable(mesh, name, [], initializer=zeros_initializer(), dtype=torch.int64, trainable=False)


def as_scalar(value, what: str, mesh: Mesh, step: Tensor | None = None):
    """A hyperparameter as a Python float or a float32 scalar Tensor.

    ``value`` may be a number, a scalar Tensor, or a callable ``fn(step) -> number | Tensor`` (a
    schedule from :mod:`meshtorch.optim.schedules`), called with the float32 step Tensor.

    Raises:
        ValueError: naming ``what`` if a Tensor is not a scalar or lives on another mesh.
        TypeError: naming ``what`` for any other kind of value.
    """
    if callable(value) and not isinstance(value, Tensor):
        if step is None:
            raise ValueError(f"{what}: a schedule (callable) needs the step tensor.")
        return as_scalar(value(step), what, mesh)
    if isinstance(value, bool):
        raise TypeError(f"{what}: expected a number, scalar Tensor or callable, got {value!r}.")
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, Tensor):
        if value.shape.ndims != 0:
            raise ValueError(f"{what}: tensor {value.name!r} must be a scalar (shape []), got {value.shape}.")
        if value.mesh is not mesh:
            raise ValueError(f"{what}: tensor {value.name!r} is on mesh {value.mesh.name!r}, not {mesh.name!r}.")
        return value if value.dtype == torch.float32 else ew.cast(value, torch.float32)
    raise TypeError(f"{what}: expected a number, scalar Tensor or callable(step) -> Tensor, got {value!r}.")


def scalar_tensor(x, mesh: Mesh) -> Tensor:
    """``x`` (float or float32 scalar Tensor) as a Tensor."""
    return x if isinstance(x, Tensor) else constant(mesh, float(x), [], torch.float32)


class Optimizer:
    """Base: ``apply_grads(grads, variables) -> [Assign]``; subclasses implement ``apply_grad``.

    Subclasses call :meth:`step_float` / :meth:`step_int` and :meth:`lr` inside ``apply_grad``; those
    are built once per mesh and apply_grads call, so many variables share one schedule subgraph.

    Args:
        learning_rate: float, scalar Tensor, or callable ``fn(step) -> Tensor`` (step: float32 scalar,
            0 at the first update).
    """

    def __init__(self, learning_rate=0.1):
        self.learning_rate = learning_rate
        self._ctx: dict = {}

    # ------------------------------------------------------------ per-mesh context
    def _context(self, mesh: Mesh) -> dict:
        ctx = getattr(self, "_ctx", None)
        if ctx is None:
            ctx = self._ctx = {}
        c = ctx.get(mesh)
        if c is None:
            step = get_or_create_global_step(mesh)
            c = ctx[mesh] = {"step": step, "step_float": ew.cast(step, torch.float32)}
        return c

    def step_int(self, mesh: Mesh) -> Tensor:
        """The global step Tensor (int64 scalar, updates before this one)."""
        return self._context(mesh)["step"]

    def step_float(self, mesh: Mesh) -> Tensor:
        """The global step as a float32 scalar Tensor (Mesh TF ``step_num()``)."""
        return self._context(mesh)["step_float"]

    def hyper(self, value, what: str, mesh: Mesh):
        """A hyperparameter (number, scalar Tensor or schedule) resolved on ``mesh`` (cached per name)."""
        c = self._context(mesh)
        key = ("hyper", what)
        if key not in c:
            c[key] = as_scalar(value, f"{type(self).__name__} {what}", mesh, c["step_float"])
        return c[key]

    def lr(self, mesh: Mesh):
        """The learning rate for this update: a Python float or a float32 scalar Tensor."""
        return self.hyper(self.learning_rate, "learning_rate", mesh)

    def lr_for(self, var) -> float | Tensor:
        """:meth:`lr` for ``var``'s update: a scheduled (float32 Tensor) rate is cast to ``var``'s dtype.

        So a float64 (or bfloat16) variable can use a schedule; the cast is cached per mesh and dtype.
        """
        lr = self.lr(var.mesh)
        if not isinstance(lr, Tensor) or lr.dtype == var.dtype:
            return lr
        c = self._context(var.mesh)
        key = ("lr_as", var.dtype)
        if key not in c:
            c[key] = ew.cast(lr, var.dtype)
        return c[key]

    # ------------------------------------------------------------ public API
    def __init_subclass__(cls, **kwargs):
        """Every optimizer's ``apply_grad`` builds its update in the variable's storage layout (see
        :meth:`apply_grads`), also when a Mesh TF program calls ``apply_grad`` per variable itself."""
        super().__init_subclass__(**kwargs)
        fn = cls.__dict__.get("apply_grad")
        if fn is None or getattr(fn, "_storage_scoped", False):
            return

        @functools.wraps(fn)
        def apply_grad(self, grad, var):
            with _as_variable(var).graph.storage_scope():
                return fn(self, grad, var)
        apply_grad._storage_scoped = True
        cls.apply_grad = apply_grad

    def apply_grads(self, grads, variables) -> list[Assign]:
        """One update per (gradient, variable) pair, plus one increment of ``global_step``.

        Pairs with a None gradient are skipped. Follows Mesh TF ``Optimizer.apply_grads``; unlike
        Mesh TF (where the training loop increments the step) the increment is returned here.

        Args:
            grads: Tensors from ``mtf.gradients`` (same named shape as each variable).
            variables: Variables or their value tensors (e.g. ``graph.trainable_variables``).

        Returns:
            list of Assign operations; fetch them all in ``lowering.run`` to apply the update.

        A gradient in another dtype than the variable's slices is cast to the slice dtype first, so
        updates are applied in the variable's own precision. The update ops are built in
        :meth:`Graph.storage_scope <meshtorch.core.graph.Graph.storage_scope>`: they see each variable,
        its slots and its gradient in the variable's storage layout.

        Raises:
            ValueError: if ``grads`` and ``variables`` differ in length.
        """
        grads, variables = list(grads), list(variables)
        if len(grads) != len(variables):
            raise ValueError(f"apply_grads: {len(grads)} gradients for {len(variables)} variables.")
        ops = []
        meshes = []
        for g, v in zip(grads, variables, strict=True):
            if g is None:
                continue
            var = _as_variable(v)
            if var.mesh not in meshes:
                meshes.append(var.mesh)
            # the update math is laid out like the variable (its storage layout): with storage rules
            # (FSDP / ZeRO-3) the gradient, a partial sum, is reduce-scattered into the variable's shards
            with var.graph.storage_scope():
                if g.dtype != var.dtype:  # e.g. a bfloat16 gradient of a mixed-precision variable's read
                    g = ew.cast(g, var.dtype)
                ops.extend(self.apply_grad(g, var))
        for mesh in meshes:
            step = self.step_int(mesh)
            ops.append(Assign([step.operation], [step + 1], name="global_step_increment"))
        return ops

    def apply_grad(self, grad: Tensor, var: Variable) -> list[Assign]:
        """Assignments updating ``var`` (and its slots) from ``grad``; no step increment."""
        raise NotImplementedError


def grouped_pairs(grads, variables, by_dtype: bool = False) -> dict:
    """The ``(gradient, Variable)`` pairs with a gradient, grouped by mesh (``by_dtype``: by ``(mesh, dtype)``),
    in order: one group per multi-tensor update (as PyTorch's foreach/fused steps group by device and dtype)."""
    groups: dict = {}
    for g, v in zip(grads, variables, strict=True):
        if g is not None:
            var = _as_variable(v)
            groups.setdefault((var.mesh, var.dtype) if by_dtype else var.mesh, []).append((g, var))
    return groups


def check_grad(grad: Tensor, var: Variable, who: str):
    """Raise a ShapeError-like ValueError naming the variable if ``grad``'s dims differ from ``var``'s."""
    if set(grad.shape.dimension_names) != set(var.shape.dimension_names) or grad.shape.size != var.shape.size:
        raise ValueError(f"{who}: gradient {grad.name!r} {grad.shape} does not match variable {var.name!r} "
                         f"{var.shape}.")

