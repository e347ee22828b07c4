"""Binary operations with broadcasting by dimension name.

The output shape is the union of the input shapes: ``x``'s dims, then ``y``'s dims that ``x``
lacks (Mesh TF's ``_infer_binary_broadcast_shape``). One name with two sizes is an error. No
communication is needed: a dimension has the same layout in every tensor. The sum or
difference of two lazily all-reduced tensors over the same mesh axes stays lazy, so sums of
partial sums cost one all-reduce. With a Python scalar operand, ``output_shape`` (a permutation of the
tensor's dims) is honoured; Mesh TF ignores it there.
"""

from __future__ import annotations

import functools

import torch

from meshtorch.core.dims import combine_shapes, convert_to_shape
from meshtorch.core.graph import Operation, Tensor
from meshtorch.ops import elementwise as ew
from meshtorch.ops._util import align_fn
from meshtorch.ops.reshape import transpose
from meshtorch.ops.variables import constant


class BinaryOperation(Operation):
    """``fn(x, y)`` on aligned slices; ``kind`` selects the gradient rule.

    Gradient: :meth:`output_shape_gradients` (the rule of ``kind``, here), then each summed over the
    dims its input lacks (``reduce_to_shape``). Reductions build on binary ops (softmax), so that last
    step is registered in :mod:`meshtorch.ops.gradients`, above both families.
    """

    storage_propagates = True

    def __init__(self, fn, x: Tensor, y: Tensor, kind: str, output_shape=None, output_dtype=None,
                 name: str | None = None):
        for t, w in ((x, "x"), (y, "y")):
            if not isinstance(t, Tensor):
                raise TypeError(f"{kind}: {w} must be an mtf Tensor or Python scalar, got {type(t).__name__}.")
        super().__init__([x, y], name=name or kind)
        self.fn = fn
        self.kind = kind
        shape = combine_shapes([x.shape, y.shape], f"{kind} {self.name!r} of {x.name!r} and {y.name!r}")
        if output_shape is not None:
            output_shape = convert_to_shape(output_shape)
            combine_shapes([shape, output_shape], f"{kind} {self.name!r}")
            if set(output_shape.dimension_names) != set(shape.dimension_names):
                raise ValueError(f"{kind} {self.name!r}: output_shape {output_shape} must hold exactly the dims "
                                 f"of the inputs {shape}.")
            shape = output_shape
        if x.dtype != y.dtype and kind not in ("where",):
            raise TypeError(f"{kind} {self.name!r}: dtypes differ ({x.name!r} is {x.dtype}, {y.name!r} is "
                            f"{y.dtype}); cast one with mtf.cast.")
        # add and subtract are linear in both inputs: partial sums over the same axes stay partial
        self.partial_sums = "linear" if kind in ("add", "subtract") else None
        self.outputs = [Tensor(self, shape, output_dtype or x.dtype)]

    @property
    def has_gradient(self):
        return self.kind in _GRADS

    def lower(self, lw):
        x, y = self.inputs
        out = self.outputs[0]
        ax, ay = align_fn(x.shape, out.shape), align_fn(y.shape, out.shape)
        fn = self.fn
        (sx, sy), pending = lw.inputs(self, allow=ax is None and ay is None)
        f = fn if ax is None and ay is None else functools.partial(_k_aligned, fn=fn, ax=ax, ay=ay)
        lw.set(out, lw.slicewise(f, sx, sy), pending)

    def output_shape_gradients(self, dy: Tensor):
        """``(gx, gy)``: the gradients of x and y in the output's shape, before the sum over the dims
        each input lacks (None: no gradient). Only for kinds with a gradient (``has_gradient``)."""
        x, y = self.inputs
        return _GRADS[self.kind](x, y, self.outputs[0], dy)


def _k_aligned(a, b, *, fn, ax, ay):
    return fn(a if ax is None else ax(a), b if ay is None else ay(b))


def _mul_grads(x, y, out, dy):
    return multiply(dy, y), multiply(dy, x)


def _k_divide_grad_y(d, o, b):
    return -d * o / b


def _div_grads(x, y, out, dy):
    gx = divide(dy, y)
    gy = ew.slicewise(_k_divide_grad_y, [dy, out, y], output_shape=out.shape, name="divide_grad_y")
    return gx, gy


def _k_minmax_weight(d, a, b, *, pick, to_x):
    """``dy`` times the share of the gradient going to x (``to_x``) or y: all of it where that
    operand was picked, half on ties (as torch.maximum / torch.minimum)."""
    picked = pick(a, b)
    w = torch.where(picked, 1.0, torch.where(a == b, 0.5, 0.0)) if to_x else \
        torch.where(picked, 0.0, torch.where(a == b, 0.5, 1.0))
    return d * w.to(d.dtype)


def _minmax_grads(pick_x):
    def grads(x, y, out, dy):
        gx = ew.slicewise(functools.partial(_k_minmax_weight, pick=pick_x, to_x=True), [dy, x, y],
                          output_shape=out.shape, name="minmax_grad_x")
        gy = ew.slicewise(functools.partial(_k_minmax_weight, pick=pick_x, to_x=False), [dy, x, y],
                          output_shape=out.shape, name="minmax_grad_y")
        return gx, gy
    return grads


_GRADS = {
    "add": lambda x, y, out, dy: (dy, dy),
    "subtract": lambda x, y, out, dy: (dy, ew.negative(dy)),
    "multiply": _mul_grads,
    "divide": _div_grads,
    "maximum": _minmax_grads(torch.gt),
    "minimum": _minmax_grads(torch.lt),
}


def _binary(fn, kind, x, y, output_shape=None, name=None, output_dtype=None, scalar_kinds=None):
    if scalar_kinds and isinstance(x, Tensor) != isinstance(y, Tensor):
        t = ew.scalar_op(y, x, scalar_kinds[1]) if isinstance(y, Tensor) else ew.scalar_op(x, y, scalar_kinds[0])
        # Mesh TF ignores output_shape with a scalar operand; we honour it as for two tensors (a local permute)
        if output_shape is None:
            return t
        return transpose(t, output_shape)
    if not isinstance(x, Tensor) or not isinstance(y, Tensor):
        x, y = _tensorize(x, y, kind)
    return BinaryOperation(fn, x, y, kind, output_shape, output_dtype, name).outputs[0]


def _tensorize(x, y, kind):
    if isinstance(x, Tensor):
        return x, constant(x.mesh, y, [], dtype=x.dtype)
    if isinstance(y, Tensor):
        return constant(y.mesh, x, [], dtype=y.dtype), y
    raise TypeError(f"{kind}: at least one operand must be an mtf Tensor.")


def add(x1, x2, output_shape=None, name=None) -> Tensor:
    """x1 + x2 (Mesh TF ``mtf.add``), broadcasting by dimension name. Shapes: union of x1's and x2's dims."""
    return _binary(torch.add, "add", x1, x2, output_shape, name, scalar_kinds=("add", "add"))


def subtract(x1, x2, output_shape=None, name=None) -> Tensor:
    """x1 - x2, broadcasting by dimension name."""
    return _binary(torch.sub, "subtract", x1, x2, output_shape, name, scalar_kinds=("sub", "rsub"))


sub = subtract


def multiply(x1, x2, output_shape=None, name=None) -> Tensor:
    """x1 * x2, broadcasting by dimension name."""
    return _binary(torch.mul, "multiply", x1, x2, output_shape, name, scalar_kinds=("mul", "mul"))


def divide(x1, x2, output_shape=None, name=None) -> Tensor:
    """x1 / x2, broadcasting by dimension name."""
    return _binary(torch.div, "divide", x1, x2, output_shape, name, scalar_kinds=("div", "rdiv"))


def minimum(x1, x2, output_shape=None, name=None) -> Tensor:
    """Elementwise min (gradient split evenly on ties, as torch.minimum)."""
    return _binary(torch.minimum, "minimum", x1, x2, output_shape, name)


def maximum(x1, x2, output_shape=None, name=None) -> Tensor:
    """Elementwise max (gradient split evenly on ties, as torch.maximum)."""
    return _binary(torch.maximum, "maximum", x1, x2, output_shape, name)


def _cmp(fn, kind):
    def op(x1, x2, output_shape=None, name=None) -> Tensor:
        return _binary(fn, kind, x1, x2, output_shape, name, output_dtype=torch.bool)
    op.__name__ = kind
    op.__doc__ = f"Elementwise ``{kind}`` with broadcasting by name; bool output, no gradient."
    return op


equal = _cmp(torch.eq, "equal")
not_equal = _cmp(torch.ne, "not_equal")
less = _cmp(torch.lt, "less")
less_equal = _cmp(torch.le, "less_equal")
greater = _cmp(torch.gt, "greater")
greater_equal = _cmp(torch.ge, "greater_equal")
logical_and = _cmp(torch.logical_and, "logical_and")
logical_or = _cmp(torch.logical_or, "logical_or")


def floordiv(x1, x2, output_shape=None) -> Tensor:
    """floor(x1 / x2) elementwise with broadcasting by name (Mesh TF ``mtf.floordiv``, ``tf.floordiv``,
    ``torch.floor_divide``); dtype of the Tensor operand; no gradient (zero almost everywhere)."""
    return _binary(torch.floor_divide, "floordiv", x1, x2, output_shape)


def mod(x1, x2, output_shape=None) -> Tensor:
    """x1 mod x2 with the sign of x2 (Mesh TF ``mtf.mod``: ``tf.math.floormod``, ``torch.remainder``);
    broadcasting by name; no gradient."""
    return _binary(torch.remainder, "mod", x1, x2, output_shape)


def _install_operators():
    Tensor.__add__ = lambda s, o: add(s, o)
    Tensor.__radd__ = lambda s, o: add(o, s)
    Tensor.__sub__ = lambda s, o: subtract(s, o)
    Tensor.__rsub__ = lambda s, o: subtract(o, s)
    Tensor.__mul__ = lambda s, o: multiply(s, o)
    Tensor.__rmul__ = lambda s, o: multiply(o, s)
    Tensor.__truediv__ = lambda s, o: divide(s, o)
    Tensor.__rtruediv__ = lambda s, o: divide(o, s)
    Tensor.__floordiv__ = lambda s, o: floordiv(s, o)
    Tensor.__rfloordiv__ = lambda s, o: floordiv(o, s)
    Tensor.__mod__ = lambda s, o: mod(s, o)
    Tensor.__rmod__ = lambda s, o: mod(o, s)
    Tensor.__neg__ = lambda s: ew.negative(s)
    Tensor.__pow__ = lambda s, c: ew.scalar_op(s, c, "pow")


_install_operators()
