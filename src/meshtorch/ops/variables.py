"""Variables, assignments, placeholders, imported tensors and constants.

Variables keep their slices in the Lowering between runs; each processor holds only its slice.
Within one ``run`` reads see the value from before the run and assignments take effect together
at the end (see :mod:`meshtorch.lowering`).
"""

from __future__ import annotations

import builtins
import functools

import numpy as np
import torch

from meshtorch.core.dims import combine_shapes, convert_to_shape
from meshtorch.core.errors import ShapeError
from meshtorch.core.graph import Mesh, Operation, Tensor
from meshtorch.core.scopes import get_variable_scope, scoped_variable_name
from meshtorch.ops._kernels import filled
from meshtorch.ops._util import align_fn
from meshtorch.ops.elementwise import cast
from meshtorch.ops.initializers import convert_initializer
from meshtorch.ops.precision import VariableDType


class Variable(Operation):
    """A trainable (or not) tensor with persistent slices. Its value is ``outputs[0]``.

    ``dtype``: a torch dtype or a :class:`~meshtorch.ops.precision.VariableDType`; the slices and
    ``outputs[0]`` have its ``slice_dtype`` (initial values are drawn in ``master_dtype``, then cast).
    """

    def __init__(self, mesh: Mesh, name: str, shape, dtype=torch.float32, initializer=None, trainable=True):
        if mesh.graph.name_in_use(name):
            raise ValueError(f"get_variable: the name {name!r} is already used in this graph; "
                             "variable names must be unique (they key checkpoints and initial values).")
        vdtype = VariableDType.of(dtype)
        super().__init__([], mesh, name=name)
        self.initializer = convert_initializer(initializer)
        self.trainable = trainable
        self.variable_dtype = vdtype
        self.outputs = [Tensor(self, convert_to_shape(shape), vdtype.slice_dtype, name=name)]
        self.graph.all_variables.append(self)
        self.graph.name_to_variable[self.name] = self
        if trainable:
            self.graph.trainable_variables.append(self)

    @property
    def value(self) -> Tensor:
        return self.outputs[0]

    @property
    def shape(self):
        return self.outputs[0].shape

    @property
    def dtype(self):
        """The slice dtype: what the variable stores and updates are applied in."""
        return self.outputs[0].dtype

    @property
    def master_dtype(self):
        return self.variable_dtype.master_dtype

    @property
    def slice_dtype(self):
        return self.variable_dtype.slice_dtype

    @property
    def activation_dtype(self):
        return self.variable_dtype.activation_dtype

    differentiable = False
    storage_side = True  # stored (and updated) in the storage layout

    def lower(self, lw):
        lw.set(self.outputs[0], lw.register_variable(self))

    def initializer_kernel(self):
        """The kernel ``fn(begin, sizes, device=None) -> torch.Tensor`` drawing one slice of the initial value
        in the master dtype, then cast to the variable's dtype: counter-based, so a slice's values do not
        depend on the layout. A ``functools.partial`` of a module-level function, plain data for
        ``Program.to_json`` unless the initializer only implements ``values``."""
        out = self.outputs[0]
        master = self.variable_dtype.master_dtype
        return self.initializer.slice_fn(out.shape, master, getattr(self.graph, "seed", 0), self.name,
                                         out_dtype=None if out.dtype == master else out.dtype)

    def initial_value(self, impl, layout):
        """The laid-out initial value on ``impl`` in ``layout``: each processor draws only its slice
        (counter-based, so the values are the same under every layout), in chunks straight into the slice
        (see :data:`meshtorch.ops.initializers.DRAW_CHUNK`); processors holding the same slice on the
        same device share one drawn tensor."""
        out = self.outputs[0]
        sizes = impl.slice_shape(out.shape, layout)
        make = self.initializer_kernel()
        drawn: dict = {}

        def draw(p):
            begin, device = tuple(impl.slice_begin(out.shape, p, layout)), impl.device(p)
            if (begin, device) not in drawn:
                drawn[begin, device] = make(begin, sizes, device)
            return drawn[begin, device]

        return impl.laid_out_constant(draw)


def get_variable(mesh: Mesh, name: str, shape, dtype=torch.float32, master_dtype=None, slice_dtype=None,
                 activation_dtype=None, initializer=None, trainable=True) -> Tensor:
    """Create a variable, or return the existing one of the same scoped name (Mesh TF ``mtf.get_variable``).

    The variable's full name is ``name`` prefixed by the enclosing :func:`mtf.variable_scope`
    names (``transformer/block_000/layer_000/SelfAttention/q``). If the graph already has a
    variable of that full name, it is returned (Mesh TF looks up ``graph.name_to_variable`` first,
    whatever the scope's ``reuse`` flag): this is how decoding loops and shared layers reuse weights.
    Inside a ``variable_scope(custom_getter=...)`` (TF1's custom getters) the getter decides what is returned
    (e.g. a pipeline's stacked weights, :class:`meshtorch.layers.pipeline.StackedVariables`).

    Args:
        mesh: the Mesh.
        name: name within the current variable scope; the full name keys the variable's random
            initial values and checkpoints.
        shape: named shape.
        initializer: an Initializer (default Glorot uniform, fans from the last dim vs the rest),
            or a number for a constant.
        dtype: torch dtype of the variable, or a :class:`~meshtorch.ops.precision.VariableDType`
            (mixed precision: slices stored in ``slice_dtype``, value returned in ``activation_dtype``).
        master_dtype, slice_dtype, activation_dtype: Mesh TF's per-dtype overrides; any given one
            replaces that field of ``dtype`` (as ``mtf.get_variable`` builds a VariableDType from them).
        trainable: listed in ``graph.trainable_variables``.

    Returns:
        Tensor of ``shape`` in the activation dtype: the variable's value, or a cast of it when the
        activation dtype differs from the slice dtype (``mtf.assign`` and the optimizers accept
        either and update the variable itself, in its slice dtype).

    Raises:
        ValueError: if the full name is already used by an operation that is not a variable.
        ShapeError: if an existing variable of that name has another shape.
        TypeError: if ``dtype`` is neither a torch dtype nor a VariableDType.
    """
    if master_dtype is not None or slice_dtype is not None or activation_dtype is not None:
        base = VariableDType.of(dtype if dtype is not None else torch.float32)
        dtype = VariableDType(master_dtype or base.master_dtype, slice_dtype or base.slice_dtype,
                              activation_dtype or base.activation_dtype)
    full_name = scoped_variable_name(name)
    custom = get_variable_scope().custom_getter
    if custom is not None:
        return custom(_get_variable, mesh, full_name, shape, dtype=dtype, initializer=initializer, trainable=trainable)
    return _get_variable(mesh, full_name, shape, dtype=dtype, initializer=initializer, trainable=trainable)


def _get_variable(mesh: Mesh, full_name: str, shape, dtype=torch.float32, initializer=None, trainable=True) -> Tensor:
    """:func:`get_variable` by full name (no scope prefix, no custom getter): the getter custom getters call."""
    var = mesh.graph.name_to_variable.get(full_name)
    if var is None:
        var = Variable(mesh, full_name, shape, dtype, initializer, trainable)
    elif var.shape != convert_to_shape(shape):
        raise ShapeError(f"get_variable: variable {full_name!r} exists with shape {var.shape}, asked for "
                         f"{convert_to_shape(shape)}; use another name or variable_scope.")
    value = var.outputs[0]
    if var.activation_dtype == value.dtype:
        return value
    # cast the stored shard (storage layout): with storage rules (FSDP) the weight is then all-gathered in the
    # activation dtype while the master copy keeps its own (FSDP2's mixed-precision param_dtype)
    with mesh.graph.storage_scope():
        out = cast(value, var.activation_dtype, name=f"{full_name}/read",
                   grad_reduce_dtype=var.variable_dtype.reduce_dtype)
    out.operation.variable = var  # lets assign / optimizers find the variable from its read
    return out


def _as_variable(v) -> Variable:
    if isinstance(v, Variable):
        return v
    if isinstance(v, Tensor) and isinstance(v.operation, Variable):
        return v.operation
    if isinstance(v, Tensor) and isinstance(getattr(v.operation, "variable", None), Variable):
        return v.operation.variable
    raise TypeError(f"Expected a variable (from mtf.get_variable), got {v!r}.")


class Assign(Operation):
    """Assign new values to variables at the end of the run that fetches this op."""

    def __init__(self, variables, new_values, name=None):
        variables = [_as_variable(v) for v in variables]
        super().__init__(list(new_values), mesh=variables[0].mesh, name=name or "assign")
        self.variables = variables
        for var, val in zip(variables, new_values, strict=True):
            combine_shapes([var.shape, val.shape], f"assign to variable {var.name!r}")
            if set(var.shape.dimension_names) != set(val.shape.dimension_names):
                raise ShapeError(f"assign: variable {var.name!r} has shape {var.shape} but the new value "
                                 f"{val.name!r} has shape {val.shape}; the dims must match.")
        for val in new_values:
            propagate_storage(val)

    differentiable = False
    storage_side = True  # the new value is laid out as the variable is stored

    def lower(self, lw):
        for var, val in zip(self.variables, self.inputs, strict=True):
            a = align_fn(val.shape, var.shape)
            dtype = var.dtype
            slot = lw.get(val)
            if a is not None or val.dtype != dtype:
                slot = lw.slicewise(functools.partial(_k_assign_value, align=a, dtype=dtype), slot)
            lw.register_assignment(self, var, slot)


def propagate_storage(value: Tensor):
    """Lay out the ops computing an assignment's new value as the variable is stored (its storage layout).

    Walks back from ``value`` through elementwise ops (``storage_propagates``) whose outputs have the
    variable's dims and whose every consumer is storage-side, and marks them storage-side: a
    hand-written update ``mtf.assign(w, w - lr * g)`` then runs on the variable's shards, and a gradient
    ``g`` that is a partial sum is reduce-scattered into them, not all-reduced (GSPMD-style propagation
    from the assignment; optimizers get the same by building their updates in ``Graph.storage_scope``).
    Without storage rules the storage and compute layouts coincide and nothing changes. Consumers
    are those in the graph when the assignment is built.
    """
    dims = set(value.shape.dimension_names)
    consumers = None
    stack = [value.operation]
    while stack:
        op = stack.pop()
        if op.storage_side or not op.storage_propagates or op.unsplittable_dims:
            continue
        if any(set(o.shape.dimension_names) != dims for o in op.outputs):
            continue
        if consumers is None:
            consumers = {}
            for c in op.graph.operations:
                for t in c.inputs:
                    consumers.setdefault(t, []).append(c)
        if not all(c.storage_side for o in op.outputs for c in consumers.get(o, ())):
            continue
        op.storage_side = True
        stack.extend(t.operation for t in op.inputs)


def _k_assign_value(t, *, align, dtype):
    return (t if align is None else align(t)).to(dtype).contiguous()


def assign_slice(variable, slice_var, val):
    """Mesh TF's default ``assign_fn``: a slice's new value is ``val`` (cast to the slice dtype).

    Called on torch slices (``slice_var``, ``val``); ``variable`` is the :class:`Variable`.
    """
    return val.to(slice_var.dtype)


def assign_add_slice(variable, slice_var, val):
    """``assign_fn`` for ``mtf.assign_add``: a slice's new value is ``slice_var + val``."""
    return slice_var + val.to(slice_var.dtype)


def assign_sub_slice(variable, slice_var, val):
    """``assign_fn`` for ``mtf.assign_sub``: a slice's new value is ``slice_var - val``."""
    return slice_var - val.to(slice_var.dtype)


def assign(var, new_val: Tensor, assign_fn=assign_slice, name=None) -> Assign:
    """Operation that sets ``var`` to ``new_val`` when fetched (Mesh TF ``mtf.assign``).

    ``assign_fn``: :func:`assign_slice` (default), :func:`assign_add_slice` or :func:`assign_sub_slice`,
    as in Mesh TF; the new value is built as graph ops (``var + new_val``...) so it is laid out and
    differentiated like any other tensor.

    Raises:
        ShapeError: naming the variable if the dims of ``new_val`` differ from the variable's.
        ValueError: for another ``assign_fn`` (a TF slice function cannot run here).
    """
    if assign_fn is assign_slice:
        return Assign([var], [new_val], name)
    v = _as_variable(var)
    if assign_fn is assign_add_slice:
        return Assign([v], [v.outputs[0] + new_val], name or "assign_add")
    if assign_fn is assign_sub_slice:
        return Assign([v], [v.outputs[0] - new_val], name or "assign_sub")
    raise ValueError(f"assign to {v.name!r}: assign_fn must be mtf.assign_slice, assign_add_slice or "
                     f"assign_sub_slice, got {assign_fn!r}; build the new value with graph ops and mtf.assign it.")


def assign_add(var, new_val: Tensor, name=None) -> Assign:
    """``var += new_val`` when fetched (Mesh TF ``mtf.assign_add``)."""
    return assign(var, new_val, assign_add_slice, name)


def assign_sub(var, new_val: Tensor, name=None) -> Assign:
    """``var -= new_val`` when fetched (Mesh TF ``mtf.assign_sub``)."""
    return assign(var, new_val, assign_sub_slice, name)


class Placeholder(Operation):
    """An input fed at every run (full tensor; each processor keeps its slice)."""

    def __init__(self, mesh, name, shape, dtype):
        super().__init__([], mesh, name=name)
        self.outputs = [Tensor(self, convert_to_shape(shape), dtype, name=self.name)]

    differentiable = False

    def lower(self, lw):
        out = self.outputs[0]
        lw.set(out, lw.register_placeholder(out))


def placeholder(mesh: Mesh, name: str, shape, dtype=torch.float32) -> Tensor:
    """A graph input fed at every ``lowering.run(..., feeds={t: torch.Tensor})``.

    The fed tensor must have the full shape (sizes in the declared dim order); feeding another
    shape raises ``FeedError`` naming the placeholder.
    """
    return Placeholder(mesh, name, shape, dtype).outputs[0]


class ImportOperation(Operation):
    """A full torch tensor captured at build time; sliced once at plan time."""

    def __init__(self, mesh, value: torch.Tensor, shape, name=None):
        super().__init__([], mesh, name=name or "import")
        shape = convert_to_shape(shape)
        if tuple(value.shape) != tuple(shape.to_integer_list()):
            raise ShapeError(f"import_tensor {self.name!r}: tensor of shape {list(value.shape)} does not match "
                             f"the named shape {shape}.")
        self.value = value
        self.outputs = [Tensor(self, shape, value.dtype, name=self.name)]

    differentiable = False

    def lower(self, lw):
        out = self.outputs[0]
        lw.set(out, lw.import_constant(out, self.value))


def _to_torch(value, dtype=None) -> torch.Tensor:
    if isinstance(value, np.ndarray):
        value = torch.from_numpy(value)
    elif not isinstance(value, torch.Tensor):
        value = torch.as_tensor(value)
    return value if dtype is None else value.to(dtype)


def import_tensor(mesh: Mesh, tf_tensor, shape=None, name=None, dtype=None) -> Tensor:
    """A constant from a full torch tensor (or numpy array, or number) with the given named shape.

    Mesh TF ``mtf.import_tf_tensor`` (``tf_tensor`` is Mesh TF's name; pass a torch tensor). Each
    processor keeps its slice (cut once, at plan time). ``shape=None``: a scalar, as in Mesh TF.

    Raises:
        ShapeError: if the tensor's sizes differ from ``shape``.
    """
    return ImportOperation(mesh, _to_torch(tf_tensor, dtype), [] if shape is None else shape, name).outputs[0]


def import_fully_replicated(mesh: Mesh, tf_tensor, shape, name=None, dtype=None) -> Tensor:
    """Like :func:`import_tensor` (Mesh TF ``mtf.import_fully_replicated``).

    In Mesh TF this differs from ``import_tf_tensor`` in how the TF value reaches the devices;
    here the full tensor is on the host either way and each processor keeps its slice, so the
    two give the same program.
    """
    return ImportOperation(mesh, _to_torch(tf_tensor, dtype), shape, name or "import_replicated").outputs[0]


class ConstantOperation(Operation):
    """A tensor of one repeated value (no data is stored beyond each processor's slice)."""

    def __init__(self, mesh, value: float, shape, dtype, name=None):
        super().__init__([], mesh, name=name or "constant")
        self.value = value
        self.outputs = [Tensor(self, convert_to_shape(shape), dtype, name=self.name)]

    differentiable = False

    def lower(self, lw):
        out = self.outputs[0]
        lw.set(out, lw.pnum_constant(out, functools.partial(filled, sizes=tuple(lw.slice_shape(out)), value=self.value,
                                                            dtype=out.dtype)))


def constant(mesh: Mesh, value, shape=None, dtype=torch.float32, name=None) -> Tensor:
    """A constant tensor: a scalar ``value`` repeated over ``shape``, or a full array of ``shape``."""
    shape = convert_to_shape(shape if shape is not None else [])
    if isinstance(value, int | float | bool) or (hasattr(value, "ndim") and value.ndim == 0):
        return ConstantOperation(mesh, float(value) if dtype.is_floating_point else value, shape, dtype,
                                 name).outputs[0]
    return import_tensor(mesh, value, shape, name, dtype)


def zeros(mesh: Mesh, shape, dtype=torch.float32, name=None) -> Tensor:
    """A tensor of zeros of the named ``shape``."""
    return constant(mesh, 0, shape, dtype, name or "zeros")


def ones(mesh: Mesh, shape, dtype=torch.float32, name=None) -> Tensor:
    """A tensor of ones of the named ``shape``."""
    return constant(mesh, 1, shape, dtype, name or "ones")


def zeros_like(t: Tensor) -> Tensor:
    """Zeros of ``t``'s mesh, shape and dtype (Mesh TF ``mtf.zeros_like``)."""
    return zeros(t.mesh, t.shape, t.dtype)


def ones_like(t: Tensor) -> Tensor:
    """Ones of ``t``'s mesh, shape and dtype (Mesh TF ``mtf.ones_like``)."""
    return ones(t.mesh, t.shape, t.dtype)


class ImportLaidOutTensorOperation(Operation):
    """A tensor given as its per-processor slices (Mesh TF's ``ImportLaidOutTensorOperation``).

    At lowering the slices are checked against the layout the rules give the tensor, assembled into
    the full tensor (replicas must agree) and imported as :class:`ImportOperation` does.
    """

    def __init__(self, mesh, slices, shape, name=None):
        super().__init__([], mesh, name=name or "import_laid_out")
        self.slices = [_to_torch(s) for s in slices]
        if not self.slices:
            raise ValueError(f"import_laid_out_tensor {self.name!r}: no slices given.")
        self.outputs = [Tensor(self, convert_to_shape(shape), self.slices[0].dtype, name=self.name)]

    differentiable = False

    def lower(self, lw):
        out = self.outputs[0]
        impl, layout = lw.mesh_spec(self), lw.tensor_layout(out)
        if len(self.slices) != impl.size:
            raise ShapeError(f"import_laid_out_tensor {self.name!r}: {len(self.slices)} slices for a mesh of "
                             f"{impl.size} processors; give one slice per processor number.")
        want = impl.slice_shape(out.shape, layout)
        full = torch.empty(out.shape.to_integer_list(), dtype=out.dtype)
        seen = torch.zeros(full.shape, dtype=torch.bool)
        for p, s in enumerate(self.slices):
            if list(s.shape) != want:
                raise ShapeError(f"import_laid_out_tensor {self.name!r}: slice {p} has shape {list(s.shape)}, the "
                                 f"layout {layout} of {out.shape} gives slices of {want}.")
            idx = tuple(builtins.slice(b, b + n) for b, n in zip(impl.slice_begin(out.shape, p, layout), want,
                                                                  strict=True))
            if bool(seen[idx].any()) and not torch.equal(full[idx], s.to(full.dtype)):
                raise ValueError(f"import_laid_out_tensor {self.name!r}: replicas of slice {p} differ.")
            full[idx] = s
            seen[idx] = True
        lw.set(out, lw.import_constant(out, full))


def import_laid_out_tensor(mesh: Mesh, laid_out_tensor, shape, name=None) -> Tensor:
    """A tensor of named ``shape`` from its slices, one per processor number (Mesh TF
    ``mtf.import_laid_out_tensor``; there a LaidOutTensor, here a list of torch tensors laid out as the
    layout rules lay out ``shape``). Raises ShapeError at lowering on a wrong count or slice shape."""
    slices = getattr(laid_out_tensor, "tensor_list", laid_out_tensor)
    return ImportLaidOutTensorOperation(mesh, list(slices), shape, name).outputs[0]
