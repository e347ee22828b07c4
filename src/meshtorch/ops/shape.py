"""Shape operations: broadcast, slice, pad, concat, split, stack, unstack, add_n, where.

Also re-exports shift, cumsum and range (``meshtorch.ops.sequence``). Names and signatures
follow Mesh TensorFlow (``mesh_tensorflow/ops.py``). As in Mesh TF, slice, pad, concat and split
keep a dimension's *name* while changing its size, so the result is laid out by the same rule.

Where Mesh TF refuses a layout (slicing, padding, concatenating or unstacking a split dim), we
lower it correctly instead: the input is all-gathered along that dim (``lw.all_gather``), the op
runs on the whole dim, and each processor keeps its piece of the output (a local slice). When
the dim is not split there is no communication. stack onto a split new dim needs none either.
"""

from __future__ import annotations

import builtins
import functools
import numbers

import torch

from meshtorch.core.dims import Dimension, combine_shapes, convert_to_shape
from meshtorch.core.errors import ShapeError
from meshtorch.core.graph import Operation, Tensor
from meshtorch.ops import sequence as _sequence
from meshtorch.ops._kernels import align_spec, aligned, cat, narrow
from meshtorch.ops._relayout import coordinate_constant, gather_dim, scatter_dim
from meshtorch.ops.elementwise import slicewise
from meshtorch.ops.reduce import reduce_to_shape
from meshtorch.ops.sequence import CumsumOperation, RangeOperation, ShiftOperation, cumsum, mtf_range, shift
from meshtorch.ops.variables import constant, zeros

range = _sequence.range  # noqa: A001 - Mesh TF's name (mtf.range)

__all__ = ["broadcast", "slice", "pad", "concat", "split", "stack", "unstack", "add_n", "where",
           "shift", "cumsum", "range", "mtf_range",
           "BroadcastOperation", "SliceOperation", "PadOperation", "ConcatOperation", "SplitOperation",
           "StackOperation", "UnstackOperation", "AddNOperation", "WhereOperation", "ShiftOperation",
           "CumsumOperation", "RangeOperation"]


def _dim_name(d) -> str:
    return d if isinstance(d, str) else d.name


def _check_int(v, what: str, op: str) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"{op}: {what} must be an integer, got {v!r}.")
    return int(v)


# ----- kernels: the local computations these ops emit (module-level, so the program is data) -----

def _k_broadcast(t: torch.Tensor, *, align, sizes) -> torch.Tensor:
    return aligned(t, align).expand(list(sizes))


def _k_pad(t: torch.Tensor, *, dim: int, before: int, after: int) -> torch.Tensor:
    parts = []
    for k in (before, after):
        shape = list(t.shape)
        shape[dim] = k
        parts.append(t.new_zeros(shape))
    return torch.cat([parts[0], t, parts[1]], dim=dim)


def _k_split(t: torch.Tensor, *, sizes, dim: int):
    return tuple(torch.split(t, list(sizes), dim=dim))


def _k_stack(*ts: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.stack(ts, dim=dim)


def _k_stack_own(c: int, *ts: torch.Tensor, dim: int, m: int) -> torch.Tensor:
    """Stack the ``m`` inputs of block ``c`` (this processor's coordinate on the new dim's axis)."""
    return torch.stack(ts[c * m:(c + 1) * m], dim=dim)


def _k_unbind(t: torch.Tensor, *, dim: int):
    return tuple(t.unbind(dim))


def _k_add_n(*ts: torch.Tensor, aligns, sizes) -> torch.Tensor:
    acc = None
    for a, t in zip(aligns, ts, strict=True):
        t = aligned(t, a)
        acc = t if acc is None else acc + t
    return acc.expand(list(sizes)) if list(acc.shape) != list(sizes) else acc


def _k_where(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, aligns, sizes) -> torch.Tensor:
    c, a, b = (aligned(t, al) for al, t in zip(aligns, (c, a, b), strict=True))
    r = torch.where(c, a, b)
    return r.expand(list(sizes)) if list(r.shape) != list(sizes) else r


def _k_where_grad(cond: torch.Tensor, d: torch.Tensor, *, keep_true: bool) -> torch.Tensor:
    zero = torch.zeros((), dtype=d.dtype, device=d.device)
    return torch.where(cond, d, zero) if keep_true else torch.where(cond, zero, d)


class BroadcastOperation(Operation):
    """Broadcast ``x`` to ``new_shape`` (must contain all of x's dims, same sizes)."""

    def __init__(self, x: Tensor, new_shape, name=None):
        super().__init__([x], name=name or "broadcast")
        new_shape = convert_to_shape(new_shape)
        combine_shapes([x.shape, new_shape], f"broadcast {self.name!r}")
        missing = [d.name for d in x.shape if d.name not in new_shape]
        if missing:
            raise ShapeError(f"broadcast {self.name!r}: new shape {new_shape} lacks dims {missing} of {x.name!r} "
                             f"{x.shape}; reduce them first.")
        self.outputs = [Tensor(self, new_shape, x.dtype)]

    def lower(self, lw):
        x, out = self.inputs[0], self.outputs[0]
        a = align_spec(x.shape, out.shape)
        sizes = lw.slice_shape(out)
        if a is None:
            lw.set(out, lw.get(x))
            return
        lw.set(out, lw.slicewise(functools.partial(_k_broadcast, align=a, sizes=tuple(sizes)), lw.get(x)))

    def gradient(self, grad_ys):
        dy = grad_ys[0]
        if dy is None:
            return [None]
        return [reduce_to_shape(dy, self.inputs[0].shape)]


def broadcast(x: Tensor, new_shape, name=None) -> Tensor:
    """``x`` broadcast to ``new_shape`` (Mesh TF ``mtf.broadcast``); no communication.

    Raises:
        ShapeError: if ``new_shape`` lacks a dim of ``x`` or gives one a different size.
    """
    new_shape = convert_to_shape(new_shape)
    if new_shape == x.shape:
        return x
    return BroadcastOperation(x, new_shape, name).outputs[0]


class _WholeDimOperation(Operation):
    """Base of ops that need one dimension whole: gather it, run ``local``, keep each processor's piece."""

    dim_name: str
    partial_sums = "linear"  # slice, pad, concat, split: partial sums over the same axes stay partial

    def _lower_whole(self, lw, local, lazy=True):
        """``local(*slots_with_whole_dim) -> tuple of per-output values``; linear ops keep a lazy sum."""
        raw, pending = lw.inputs(self, allow=lazy)
        slots = [gather_dim(lw, x, s, self.dim_name) for x, s in zip(self.inputs, raw, strict=True)]
        n = len(self.outputs)
        out_slots = lw.slicewise(local, *slots, num_outputs=n)
        out_slots = [out_slots] if n == 1 else list(out_slots)
        for out, s in zip(self.outputs, out_slots, strict=True):
            lw.set(out, scatter_dim(lw, out, s, self.dim_name), pending)


class SliceOperation(_WholeDimOperation):
    """``x[..., begin:begin+size, ...]`` along ``slice_dim_name``; the dim keeps its name."""

    def __init__(self, x: Tensor, begin: int, size: int, slice_dim_name: str, name=None):
        super().__init__([x], name=name or "slice")
        what = f"slice {self.name!r}"
        begin, size = _check_int(begin, "begin", what), _check_int(size, "size", what)
        if slice_dim_name not in x.shape:
            raise ShapeError(f"{what}: tensor {x.name!r} {x.shape} has no dimension {slice_dim_name!r}.")
        n = x.shape.get_dim_by_name(slice_dim_name).size
        if begin < 0 or size < 1 or begin + size > n:
            raise ShapeError(f"{what}: [begin={begin}, begin+size={begin + size}) is not inside dimension "
                             f"{slice_dim_name!r} of size {n} of tensor {x.name!r}; need 0 <= begin and "
                             f"1 <= size <= {n} - begin.")
        self.begin, self.size, self.dim_name = begin, size, slice_dim_name
        self.outputs = [Tensor(self, x.shape.resize_dimension(slice_dim_name, size), x.dtype)]

    def lower(self, lw):
        i, b, s = self.inputs[0].shape.get_dim_index(self.dim_name), self.begin, self.size
        self._lower_whole(lw, functools.partial(narrow, dim=i, start=b, length=s))

    def gradient(self, grad_ys):
        dy = grad_ys[0]
        if dy is None:
            return [None]
        n = self.inputs[0].shape.get_dim_by_name(self.dim_name).size
        return [pad(dy, [self.begin, n - self.begin - self.size], self.dim_name, name=f"{self.name}_grad")]


def slice(x: Tensor, begin: int, size: int, slice_dim_name, name=None) -> Tensor:  # noqa: A001 - Mesh TF name
    """``size`` elements of ``x`` along ``slice_dim_name`` starting at ``begin`` (Mesh TF ``mtf.slice``).

    Returns:
        Tensor of ``x.shape`` with that dim resized to ``size`` (same name), ``x``'s dtype.
        Layouts: all. If the dim is split: all-gather of ``x`` along it, local slice (Mesh TF
        rejects this); else no communication.

    Raises:
        ShapeError: naming ``x`` and the dim, if the dim is missing or the bounds fall outside it.
    """
    return SliceOperation(x, begin, size, _dim_name(slice_dim_name), name).outputs[0]


class PadOperation(_WholeDimOperation):
    """Zero-pad ``x`` by ``paddings = [before, after]`` along ``dim_name``; the dim keeps its name."""

    def __init__(self, x: Tensor, paddings, dim_name: str, name=None):
        super().__init__([x], name=name or "pad")
        what = f"pad {self.name!r}"
        if dim_name not in x.shape:
            raise ShapeError(f"{what}: tensor {x.name!r} {x.shape} has no dimension {dim_name!r}.")
        if len(paddings) != 2:
            raise ValueError(f"{what}: paddings must be [before, after], got {paddings!r}.")
        before, after = paddings
        before, after = _check_int(before, "paddings[0]", what), _check_int(after, "paddings[1]", what)
        if before < 0 or after < 0:
            raise ValueError(f"{what}: paddings of {x.name!r} along {dim_name!r} must be >= 0, got {paddings!r}.")
        self.before, self.after, self.dim_name = before, after, dim_name
        n = x.shape.get_dim_by_name(dim_name).size
        self.outputs = [Tensor(self, x.shape.resize_dimension(dim_name, n + before + after), x.dtype)]

    def lower(self, lw):
        i = self.inputs[0].shape.get_dim_index(self.dim_name)
        self._lower_whole(lw, functools.partial(_k_pad, dim=i, before=self.before, after=self.after))

    def gradient(self, grad_ys):
        dy = grad_ys[0]
        if dy is None:
            return [None]
        n = self.inputs[0].shape.get_dim_by_name(self.dim_name).size
        return [slice(dy, self.before, n, self.dim_name, name=f"{self.name}_grad")]


def pad(x: Tensor, paddings, dim_name, name=None) -> Tensor:
    """Zero padding of ``x`` along ``dim_name``: ``paddings = [before, after]`` (Mesh TF ``mtf.pad``).

    Returns:
        Tensor of ``x.shape`` with that dim grown by before + after (same name). Layouts: all; a
        split dim costs one all-gather of ``x`` then a local slice (Mesh TF rejects it).

    Raises:
        ShapeError / ValueError: naming ``x``, if the dim is missing or a padding is negative.
    """
    return PadOperation(x, list(paddings), _dim_name(dim_name), name).outputs[0]


class ConcatOperation(_WholeDimOperation):
    """Concatenate ``xs`` along ``concat_dim_name`` (sizes may differ; all other dims equal)."""

    def __init__(self, xs, concat_dim_name: str, name=None):
        super().__init__(xs, name=name or "concat")
        what = f"concat {self.name!r}"
        if not xs:
            raise ValueError(f"{what}: needs at least one tensor.")
        x0 = xs[0]
        for x in xs:
            if concat_dim_name not in x.shape:
                raise ShapeError(f"{what}: tensor {x.name!r} {x.shape} has no dimension {concat_dim_name!r}.")
            if (x.shape - concat_dim_name) != (x0.shape - concat_dim_name) or \
                    x.shape.get_dim_index(concat_dim_name) != x0.shape.get_dim_index(concat_dim_name):
                raise ShapeError(f"{what}: tensor {x.name!r} {x.shape} differs from {x0.name!r} {x0.shape} in a "
                                 f"dimension other than {concat_dim_name!r}; all inputs need the same other dims "
                                 "in the same order.")
            if x.dtype != x0.dtype:
                raise TypeError(f"{what}: tensor {x.name!r} is {x.dtype}, {x0.name!r} is {x0.dtype}.")
        self.dim_name = concat_dim_name
        self.sizes = [x.shape.get_dim_by_name(concat_dim_name).size for x in xs]
        self.outputs = [Tensor(self, x0.shape.resize_dimension(concat_dim_name, sum(self.sizes)), x0.dtype)]

    def lower(self, lw):
        i = self.inputs[0].shape.get_dim_index(self.dim_name)
        self._lower_whole(lw, functools.partial(cat, dim=i))

    def gradient(self, grad_ys):
        dy = grad_ys[0]
        if dy is None:
            return [None] * len(self.inputs)
        out, b = [], 0
        for k, s in enumerate(self.sizes):
            out.append(slice(dy, b, s, self.dim_name, name=f"{self.name}_grad{k}"))
            b += s
        return out


def concat(xs, concat_dim_name, name=None) -> Tensor:
    """Concatenate along ``concat_dim_name`` (Mesh TF ``mtf.concat``); the dim keeps its name.

    Args:
        xs: list of Tensors with the same dims in the same order, same dtype; only the size of
            ``concat_dim_name`` may differ.

    Returns:
        Tensor with that dim's size the sum of the inputs'. Layouts: all; a split dim costs an
        all-gather of each input then a local slice (Mesh TF rejects it).

    Raises:
        ShapeError: naming the tensor, if one lacks the dim or differs in another dim.
    """
    xs = list(xs)
    if len(xs) == 1:
        return xs[0]
    return ConcatOperation(xs, _dim_name(concat_dim_name), name).outputs[0]


class SplitOperation(_WholeDimOperation):
    """Split ``x`` along ``split_dim`` into pieces of the given sizes (each keeps the dim's name)."""

    def __init__(self, x: Tensor, split_dim: str, sizes, name=None):
        super().__init__([x], name=name or "split")
        self.dim_name, self.sizes = split_dim, list(sizes)
        self.outputs = [Tensor(self, x.shape.resize_dimension(split_dim, s), x.dtype, index=k)
                        for k, s in enumerate(self.sizes)]

    def lower(self, lw):
        i, sizes = self.inputs[0].shape.get_dim_index(self.dim_name), self.sizes
        self._lower_whole(lw, functools.partial(_k_split, sizes=tuple(sizes), dim=i))

    def gradient(self, grad_ys):
        parts = [g if g is not None else zeros(o.mesh, o.shape, o.dtype) for g, o in zip(grad_ys, self.outputs,
                                                                                          strict=True)]
        return [concat(parts, self.dim_name, name=f"{self.name}_grad")]


def split(x: Tensor, split_dim, num_or_size_splits, name=None) -> list[Tensor]:
    """Split ``x`` along ``split_dim`` (Mesh TF ``mtf.split``, like ``tf.split``).

    Args:
        split_dim: Dimension or name of ``x``.
        num_or_size_splits: number of equal pieces (must divide the size) or a list of sizes
            summing to the size.

    Returns:
        list of Tensors of ``x.shape`` with that dim resized (same name). Layouts: all; a split dim
        costs one all-gather of ``x`` then local slices.

    Raises:
        ShapeError: naming ``x``, if the dim is missing or the sizes do not add up.
    """
    name_ = _dim_name(split_dim)
    if name_ not in x.shape:
        raise ShapeError(f"split: tensor {x.name!r} {x.shape} has no dimension {name_!r}.")
    n = x.shape.get_dim_by_name(name_).size
    if isinstance(num_or_size_splits, int):
        k = num_or_size_splits
        if k < 1 or n % k:
            raise ShapeError(f"split: dimension {name_!r} of size {n} of {x.name!r} cannot be split into {k} "
                             "equal pieces.")
        sizes = [n // k] * k
    else:
        sizes = list(num_or_size_splits)
        if sum(sizes) != n or any(s < 1 for s in sizes):
            raise ShapeError(f"split: sizes {sizes} must be positive and sum to {n}, the size of {name_!r} in "
                             f"{x.name!r}.")
    if len(sizes) == 1:
        return [x]
    return list(SplitOperation(x, name_, sizes, name).outputs)


class StackOperation(Operation):
    """Stack same-shape ``xs`` along a new dim ``dim_name`` (size len(xs)) inserted at ``axis``."""

    def __init__(self, xs, dim_name: str, axis: int, name=None):
        super().__init__(xs, name=name or "stack")
        what = f"stack {self.name!r}"
        x0 = xs[0]
        for x in xs:
            if x.shape != x0.shape or x.dtype != x0.dtype:
                raise ShapeError(f"{what}: tensor {x.name!r} {x.shape} {x.dtype} differs from {x0.name!r} "
                                 f"{x0.shape} {x0.dtype}; stack needs equal shapes and dtypes.")
        if dim_name in x0.shape:
            raise ShapeError(f"{what}: tensors already have a dimension {dim_name!r} ({x0.name!r} {x0.shape}).")
        if not -x0.shape.ndims - 1 <= axis <= x0.shape.ndims:
            raise ValueError(f"{what}: axis {axis} out of range for {x0.shape.ndims + 1} output dims.")
        self.axis = axis % (x0.shape.ndims + 1)
        self.dim_name = dim_name
        dims = list(x0.shape.dims)
        dims.insert(self.axis, Dimension(dim_name, len(xs)))
        self.outputs = [Tensor(self, dims, x0.dtype)]

    def lower(self, lw):
        out = self.outputs[0]
        ax = self.axis
        a = lw.tensor_layout(out)[ax]
        slots = [lw.get(x) for x in self.inputs]
        if a is None:
            lw.set(out, lw.slicewise(functools.partial(_k_stack, dim=ax), *slots))
            return
        m = lw.slice_shape(out)[ax]  # each processor stacks only its own m inputs: no communication
        f = functools.partial(_k_stack_own, dim=ax, m=m)
        lw.set(out, lw.slicewise(f, coordinate_constant(lw, out, a), *slots))

    def gradient(self, grad_ys):
        dy = grad_ys[0]
        if dy is None:
            return [None] * len(self.inputs)
        return unstack(dy, self.dim_name, name=f"{self.name}_grad")


def stack(xs, dim_name: str, axis: int = 0, name=None) -> Tensor:
    """Stack tensors of one shape along a new dim ``dim_name`` at position ``axis`` (Mesh TF ``mtf.stack``).

    Returns:
        Tensor of ``xs[0].shape`` with ``Dimension(dim_name, len(xs))`` inserted. Layouts: all; no
        communication (if the new dim is split, each processor stacks its own inputs).

    Raises:
        ShapeError: naming the tensor whose shape or dtype differs, or if the name is taken.
    """
    xs = list(xs)
    if not xs:
        raise ValueError("stack: needs at least one tensor.")
    return StackOperation(xs, dim_name, axis, name).outputs[0]


class UnstackOperation(_WholeDimOperation):
    """``x`` split along ``dim`` into ``dim.size`` tensors without that dim."""

    def __init__(self, x: Tensor, dim_name: str, name=None):
        super().__init__([x], name=name or "unstack")
        if dim_name not in x.shape:
            raise ShapeError(f"unstack {self.name!r}: tensor {x.name!r} {x.shape} has no dimension {dim_name!r}.")
        self.dim_name = dim_name
        self.axis = x.shape.get_dim_index(dim_name)
        n = x.shape.get_dim_by_name(dim_name).size
        self.outputs = [Tensor(self, x.shape - dim_name, x.dtype, index=k) for k in builtins.range(n)]

    def _lower_whole(self, lw, local, lazy=True):
        x = self.inputs[0]
        (s,), pending = lw.inputs(self)
        s = gather_dim(lw, x, s, self.dim_name)
        n = len(self.outputs)
        outs = lw.slicewise(local, s, num_outputs=n)
        for out, o in zip(self.outputs, [outs] if n == 1 else outs, strict=True):
            lw.set(out, o, pending)

    def lower(self, lw):
        ax = self.axis
        self._lower_whole(lw, functools.partial(_k_unbind, dim=ax))

    def gradient(self, grad_ys):
        parts = [g if g is not None else zeros(o.mesh, o.shape, o.dtype) for g, o in zip(grad_ys, self.outputs,
                                                                                          strict=True)]
        return [stack(parts, self.dim_name, self.axis, name=f"{self.name}_grad")]


def unstack(x: Tensor, dim, name=None) -> list[Tensor]:
    """``dim.size`` tensors of ``x.shape - dim`` (Mesh TF ``mtf.unstack``).

    Layouts: all. Mesh TF rejects a split ``dim``; here it costs one all-gather of ``x``.

    Raises:
        ShapeError: naming ``x``, if it lacks ``dim``.
    """
    return list(UnstackOperation(x, _dim_name(dim), name).outputs)


class AddNOperation(Operation):
    """Sum of ``xs``, broadcasting by name to the union of their shapes."""

    partial_sums = "linear"  # sums of partial sums over the same axes stay one lazy all-reduce

    def __init__(self, xs, name=None):
        super().__init__(xs, name=name or "add_n")
        for x in xs:
            if x.dtype != xs[0].dtype:
                raise TypeError(f"add_n {self.name!r}: {x.name!r} is {x.dtype}, {xs[0].name!r} is {xs[0].dtype}.")
        shape = combine_shapes([x.shape for x in xs], f"add_n {self.name!r} of {[x.name for x in xs]}")
        self.outputs = [Tensor(self, shape, xs[0].dtype)]

    def lower(self, lw):
        out = self.outputs[0]
        aligns = tuple(align_spec(x.shape, out.shape) for x in self.inputs)
        slots, pending = lw.inputs(self, allow=all(a is None for a in aligns))
        f = functools.partial(_k_add_n, aligns=aligns, sizes=tuple(lw.slice_shape(out)))
        lw.set(out, lw.slicewise(f, *slots), pending)

    def gradient(self, grad_ys):
        dy = grad_ys[0]
        if dy is None:
            return [None] * len(self.inputs)
        return [reduce_to_shape(dy, x.shape) for x in self.inputs]


def add_n(xs, name=None) -> Tensor:
    """Sum of a list of tensors (Mesh TF ``mtf.add_n``), broadcasting by dimension name.

    One op (one pass over the slices); partial sums pending over the same mesh axes stay lazy,
    so they cost one all-reduce. Returns the union shape, the inputs' dtype.

    Raises:
        ShapeError: one name with two sizes; TypeError: mixed dtypes.
    """
    xs = list(xs)
    if not xs:
        raise ValueError("add_n: needs at least one tensor.")
    if len(xs) == 1:
        return xs[0]
    return AddNOperation(xs, name).outputs[0]


class WhereOperation(Operation):
    """``torch.where(condition, x, y)`` with broadcasting by name: a true select."""

    def __init__(self, condition: Tensor, x: Tensor, y: Tensor, output_shape=None, name=None):
        super().__init__([condition, x, y], name=name or "where")
        what = f"where {self.name!r}"
        if condition.dtype != torch.bool:
            raise TypeError(f"{what}: condition {condition.name!r} must be bool, got {condition.dtype}; compare "
                            "first (e.g. mtf.greater(c, 0)).")
        if x.dtype != y.dtype:
            raise TypeError(f"{what}: x {x.name!r} is {x.dtype} but y {y.name!r} is {y.dtype}; cast one.")
        shape = combine_shapes([condition.shape, x.shape, y.shape], what)
        if output_shape is not None:
            output_shape = convert_to_shape(output_shape)
            if sorted(output_shape.dims) != sorted(shape.dims):
                raise ShapeError(f"{what}: output_shape {output_shape} must hold exactly the dims {shape} of the "
                                 "inputs.")
            shape = output_shape
        self.outputs = [Tensor(self, shape, x.dtype)]

    def lower(self, lw):
        out = self.outputs[0]
        aligns = tuple(align_spec(t.shape, out.shape) for t in self.inputs)
        f = functools.partial(_k_where, aligns=aligns, sizes=tuple(lw.slice_shape(out)))
        lw.set(out, lw.slicewise(f, *[lw.get(t) for t in self.inputs]))

    def gradient(self, grad_ys):
        dy = grad_ys[0]
        if dy is None:
            return [None, None, None]
        c, x, y = self.inputs
        gx = slicewise(functools.partial(_k_where_grad, keep_true=True), [c, dy], output_shape=dy.shape,
                       output_dtype=dy.dtype, name=f"{self.name}_grad_x")
        gy = slicewise(functools.partial(_k_where_grad, keep_true=False), [c, dy], output_shape=dy.shape,
                       output_dtype=dy.dtype, name=f"{self.name}_grad_y")
        return [None, reduce_to_shape(gx, x.shape), reduce_to_shape(gy, y.shape)]


def where(condition: Tensor, if_true, if_false, output_shape=None, name=None) -> Tensor:
    """``if_true`` where ``condition`` else ``if_false``, broadcasting by name (Mesh TF ``mtf.where``).

    A true select (``torch.where``), not Mesh TF's arithmetic blend: NaN or inf in the branch not
    taken never reaches the value, and the gradient of ``x`` is ``where(condition, dy, 0)`` (of
    ``y``: ``where(condition, 0, dy)``), summed over broadcast dims. No communication.

    Args:
        condition: bool Tensor. if_true, if_false (Mesh TF's names; x, y below): Tensors or Python
            scalars (one at least a Tensor), same dtype.

    Raises:
        TypeError: a non-bool condition or differing dtypes; ShapeError: one name with two sizes.
    """
    x, y = if_true, if_false
    if not isinstance(x, Tensor) and not isinstance(y, Tensor):
        raise TypeError("where: x or y must be an mtf Tensor.")
    if not isinstance(x, Tensor):
        x = constant(condition.mesh, x, [], dtype=y.dtype)
    if not isinstance(y, Tensor):
        y = constant(condition.mesh, y, [], dtype=x.dtype)
    return WhereOperation(condition, x, y, output_shape, name).outputs[0]

