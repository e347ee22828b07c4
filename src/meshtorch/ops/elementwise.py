"""Slicewise (elementwise) operations: one torch function applied to every processor's slice.

Includes the generic :func:`slicewise` (Mesh TF's ``mtf.slicewise``) and the unary family
(relu, exp, log, sqrt, rsqrt, tanh, sigmoid, gelu, square, negative, reciprocal, abs, sign, cast,
identity, stop_gradient). None of them communicates: an elementwise op needs no data from other
processors under any layout.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch

from meshtorch.core.dims import combine_shapes, convert_to_shape
from meshtorch.core.graph import Operation, Tensor
from meshtorch.ops._kernels import align_spec, apply_aligned


class SlicewiseOperation(Operation):
    """Apply ``fn`` to aligned slices of ``xs``; output shape ``output_shape`` (default: union).

    ``grad_function(op, dy)`` returns a list of input gradients (graph tensors). ``linear=True``
    (single input, ``fn`` linear) lets a pending lazy all-reduce pass through unforced.
    """

    storage_propagates = True

    def __init__(self, fn: Callable, xs: Sequence[Tensor], output_shape=None, output_dtype=None,
                 grad_function=None, name: str | None = None, linear: bool = False,
                 unsplittable_dims: Sequence[str] = ()):
        super().__init__(xs, name=name or getattr(fn, "__name__", "slicewise").strip("_<>") or "slicewise")
        self.fn = fn
        self.grad_function = grad_function
        self.linear = linear and len(xs) == 1
        self.unsplittable_dims = tuple(unsplittable_dims)
        shape = convert_to_shape(output_shape) if output_shape is not None else combine_shapes(
            [x.shape for x in xs], f"{type(self).__name__} {self.name!r}")
        if output_shape is not None:
            combine_shapes([shape] + [x.shape for x in xs], f"{self.name!r}")
            for x in xs:
                for d in x.shape:
                    if d.name not in shape:
                        raise ValueError(f"slicewise {self.name!r}: input {x.name!r} has dimension {d.name!r} "
                                         f"that the output shape {shape} lacks; reduce it first.")
        self.outputs = [Tensor(self, shape, output_dtype or xs[0].dtype)]

    @property
    def has_gradient(self):
        return self.grad_function is not None

    def gradient(self, grad_ys):
        dy = grad_ys[0]
        if dy is None or self.grad_function is None:
            return [None] * len(self.inputs)
        return list(self.grad_function(self, dy))

    def lower(self, lw):
        out = self.outputs[0]
        aligns = tuple(align_spec(x.shape, out.shape) for x in self.inputs)
        fn = self.fn
        if self.linear:
            slot, pending = lw.get_lazy(self.inputs[0])
            lw.set(out, lw.slicewise(fn, slot), pending, source=(self.inputs[0], fn))
            return
        slots = [lw.get(x) for x in self.inputs]
        f = fn if all(a is None for a in aligns) else functools.partial(apply_aligned, fn=fn, aligns=aligns)
        lw.set(out, lw.slicewise(f, *slots))


def slicewise(tf_fn: Callable, xs, output_shape=None, output_dtype=None, splittable_dims=None, grad_function=None,
              name: str | None = None, unsplittable_dims: Sequence[str] = ()) -> Tensor:
    """Apply an elementwise torch function to each slice (Mesh TF ``mtf.slicewise``).

    Inputs are aligned by dimension name and broadcast to ``output_shape`` (default: the union
    of input shapes, in first-seen order). ``tf_fn`` (Mesh TF's name; a torch function here) must act
    elementwise over every dim that may be split; list the others in ``unsplittable_dims``, or, as
    Mesh TF does, list the dims that may be split in ``splittable_dims`` (every other dim is kept whole).

    Returns:
        Tensor of ``output_shape``, dtype ``output_dtype`` (default: first input's).
    """
    if isinstance(xs, Tensor):
        xs = [xs]
    unsplittable = list(unsplittable_dims)
    if splittable_dims is not None:
        keep = {d if isinstance(d, str) else d.name for d in splittable_dims}
        names = [d.name for x in xs for d in x.shape]
        names += [d.name for d in convert_to_shape(output_shape)] if output_shape is not None else []
        unsplittable += [n for n in dict.fromkeys(names) if n not in keep and n not in unsplittable]
    return SlicewiseOperation(tf_fn, xs, output_shape, output_dtype, grad_function, name,
                              unsplittable_dims=unsplittable).outputs[0]


def _unary(fn, x: Tensor, grad, name, dtype=None, linear=False) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name}: expected an mtf Tensor, got {type(x).__name__}.")
    return SlicewiseOperation(fn, [x], output_dtype=dtype, grad_function=grad, name=name, linear=linear).outputs[0]


def _g2(fn, name):
    """Gradient as one fused slicewise op of (input or output, dy)."""
    return lambda a, dy: slicewise(fn, [a, dy], output_shape=dy.shape, output_dtype=dy.dtype, name=name)


# ----- kernels: the local computations these ops emit (module-level, so the program is data) -----

def _k_log_grad(a, d):
    return d / a


def _k_sqrt_grad(y, d):
    return d * 0.5 / y


def _k_rsqrt_grad(y, d):
    return d * (-0.5) * y * y * y


def _k_tanh_grad(y, d):
    """dy * (1 - y**2) for y = tanh(x), through PyTorch's fused ``aten.tanh_backward``."""
    return torch.ops.aten.tanh_backward(d, y)


def _k_sigmoid_grad(y, d):
    """dy * y * (1 - y) for y = sigmoid(x), through PyTorch's fused ``aten.sigmoid_backward``."""
    return torch.ops.aten.sigmoid_backward(d, y)


def _k_gelu(t, *, approximate: str):
    return torch.nn.functional.gelu(t, approximate=approximate)


def _k_square_grad(a, d):
    return 2 * a * d


def _k_reciprocal_grad(y, d):
    return -d * y * y


def _k_abs_grad(a, d):
    return d * torch.sign(a)


def _k_cast(t, *, dtype: torch.dtype):
    return t.to(dtype)


def _k_identity(t):
    return t


def _k_add_scalar(t, *, c):
    return t + c


def _k_sub_scalar(t, *, c):
    return t - c


def _k_rsub_scalar(t, *, c):
    return c - t


def _k_mul_scalar(t, *, c):
    return t * c


def _k_div_scalar(t, *, c):
    return t / c


def _k_rdiv_scalar(t, *, c):
    return c / t


def _k_rdiv_grad(a, d, *, c):
    return -d * c / (a * a)


def _k_pow_scalar(t, *, c):
    return t ** c


def _k_pow_grad(a, d, *, c):
    return d * c * a ** (c - 1)


def _relu_grad(x, dy):
    """dy where x > 0, else 0, through PyTorch's fused ``aten.threshold_backward`` (relu's own backward)."""
    return torch.ops.aten.threshold_backward(dy, x, 0)


def relu(x: Tensor, name: str | None = None) -> Tensor:
    """max(x, 0), elementwise. Gradient: dy where x > 0, else 0 (torch convention at 0)."""
    return _unary(torch.relu, x, lambda op, dy: [_g2(_relu_grad, "relu_grad")(op.inputs[0], dy)], name or "relu")


def exp(x: Tensor, name: str | None = None) -> Tensor:
    """e**x elementwise; gradient dy * exp(x)."""
    return _unary(torch.exp, x, lambda op, dy: [_g2(torch.mul, "exp_grad")(op.outputs[0], dy)], name or "exp")


def log(x: Tensor, name: str | None = None) -> Tensor:
    """Natural log elementwise; gradient dy / x."""
    return _unary(torch.log, x, lambda op, dy: [_g2(_k_log_grad, "log_grad")(op.inputs[0], dy)],
                  name or "log")


def sqrt(x: Tensor, name: str | None = None) -> Tensor:
    """sqrt(x) elementwise; gradient dy * 0.5 / sqrt(x)."""
    return _unary(torch.sqrt, x, lambda op, dy: [_g2(_k_sqrt_grad, "sqrt_grad")(op.outputs[0], dy)],
                  name or "sqrt")


def rsqrt(x: Tensor, name: str | None = None) -> Tensor:
    """1/sqrt(x) elementwise; gradient -0.5 * dy * rsqrt(x)**3."""
    return _unary(torch.rsqrt, x,
                  lambda op, dy: [_g2(_k_rsqrt_grad, "rsqrt_grad")(op.outputs[0], dy)],
                  name or "rsqrt")


def tanh(x: Tensor, name: str | None = None) -> Tensor:
    """tanh elementwise; gradient dy * (1 - tanh(x)**2)."""
    return _unary(torch.tanh, x, lambda op, dy: [_g2(_k_tanh_grad, "tanh_grad")(op.outputs[0], dy)],
                  name or "tanh")


def sigmoid(x: Tensor, name: str | None = None) -> Tensor:
    """Logistic sigmoid elementwise; gradient dy * s * (1 - s)."""
    return _unary(torch.sigmoid, x,
                  lambda op, dy: [_g2(_k_sigmoid_grad, "sigmoid_grad")(op.outputs[0], dy)],
                  name or "sigmoid")


def _gelu_grad_exact(x, dy):
    """GELU (erf form) gradient through PyTorch's fused ``aten.gelu_backward``."""
    return torch.ops.aten.gelu_backward(dy, x, approximate="none")


def _gelu_grad_tanh(x, dy):
    """GELU (tanh form) gradient through PyTorch's fused ``aten.gelu_backward``."""
    return torch.ops.aten.gelu_backward(dy, x, approximate="tanh")


def gelu(x: Tensor, approximate: str = "none", name: str | None = None) -> Tensor:
    """GELU (Hendrycks & Gimpel 2016) as ``torch.nn.functional.gelu(x, approximate=...)``.

    ``approximate``: ``"none"`` (erf form, default) or ``"tanh"``.
    """
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}.")
    g = _gelu_grad_exact if approximate == "none" else _gelu_grad_tanh
    return _unary(functools.partial(_k_gelu, approximate=approximate), x,
                  lambda op, dy: [_g2(g, "gelu_grad")(op.inputs[0], dy)], name or "gelu")


def square(x: Tensor, name: str | None = None) -> Tensor:
    """x*x elementwise; gradient 2 x dy."""
    return _unary(torch.square, x, lambda op, dy: [_g2(_k_square_grad, "square_grad")(op.inputs[0], dy)],
                  name or "square")


def negative(x: Tensor, name: str | None = None) -> Tensor:
    """-x elementwise (linear: a pending lazy all-reduce passes through)."""
    return _unary(torch.neg, x, lambda op, dy: [negative(dy)], name or "negative", linear=True)


def reciprocal(x: Tensor, name: str | None = None) -> Tensor:
    """1/x elementwise; gradient -dy / x**2."""
    return _unary(torch.reciprocal, x,
                  lambda op, dy: [_g2(_k_reciprocal_grad, "reciprocal_grad")(op.outputs[0], dy)],
                  name or "reciprocal")


def abs(x: Tensor, name: str | None = None) -> Tensor:  # noqa: A001 - Mesh TF's name
    """|x| elementwise; gradient dy * sign(x) (0 at 0, as torch)."""
    return _unary(torch.abs, x, lambda op, dy: [_g2(_k_abs_grad, "abs_grad")(op.inputs[0], dy)],
                  name or "abs")


def sign(x: Tensor, name: str | None = None) -> Tensor:
    """-1, 0 or 1 elementwise; no gradient (zero almost everywhere)."""
    return _unary(torch.sign, x, lambda op, dy: [None], name or "sign")


def cast(x: Tensor, dtype: torch.dtype, name: str | None = None,
         grad_reduce_dtype: torch.dtype | None = None) -> Tensor:
    """``x`` converted to ``dtype``; the gradient is cast back to ``x``'s dtype (none for non-float).

    ``grad_reduce_dtype``: the dtype in which a gradient that is a pending partial sum is summed over processors
    (a mixed-precision weight read, :class:`~meshtorch.ops.precision.VariableDType`'s ``reduce_dtype``): the
    gradient is first cast to it by a cast that lets the partial sum pass (exact for a widening cast), so the
    all-reduce / reduce-scatter runs in it. None: the sum runs in the gradient's own dtype."""
    if x.dtype == dtype:
        return x

    def grad(op, dy):
        if not op.inputs[0].dtype.is_floating_point:
            return [None]
        if grad_reduce_dtype is not None and grad_reduce_dtype != dy.dtype:
            dy = _unary(functools.partial(_k_cast, dtype=grad_reduce_dtype), dy, None, f"{op.name}_grad_cast",
                        dtype=grad_reduce_dtype, linear=True)
            # in the compute layout, where dy is still a partial sum (a storage-side op would see it reduced)
            dy.operation.storage_side = False
        return [cast(dy, op.inputs[0].dtype)]

    return _unary(functools.partial(_k_cast, dtype=dtype), x, grad if dtype.is_floating_point else None,
                  name or "cast", dtype=dtype)


def identity(x: Tensor, name: str | None = None) -> Tensor:
    """A copy of ``x`` (a new tensor name); gradient passes through."""
    return _unary(_k_identity, x, lambda op, dy: [dy], name or "identity", linear=True)


def stop_gradient(x: Tensor, name: str | None = None) -> Tensor:
    """``x`` in the forward pass; no gradient flows back through it (``torch.Tensor.detach``)."""
    return _unary(_k_identity, x, None, name or "stop_gradient", linear=True)


def scalar_op(x: Tensor, c: float, kind: str) -> Tensor:
    """``x <kind> c`` for a Python scalar ``c``: kinds add, sub, rsub, mul, div, rdiv, pow."""
    c = float(c) if not isinstance(c, bool | int) or kind in ("div", "rdiv", "pow") else c
    if kind == "add":
        return _unary(functools.partial(_k_add_scalar, c=c), x, lambda op, dy: [dy], "add_scalar")
    if kind == "sub":
        return _unary(functools.partial(_k_sub_scalar, c=c), x, lambda op, dy: [dy], "sub_scalar")
    if kind == "rsub":
        return _unary(functools.partial(_k_rsub_scalar, c=c), x, lambda op, dy: [negative(dy)], "rsub_scalar")
    if kind == "mul":
        return _unary(functools.partial(_k_mul_scalar, c=c), x, lambda op, dy: [scalar_op(dy, c, "mul")],
                      "mul_scalar", linear=True)
    if kind == "div":
        return _unary(functools.partial(_k_div_scalar, c=c), x, lambda op, dy: [scalar_op(dy, c, "div")],
                      "div_scalar", linear=True)
    if kind == "rdiv":
        # d(c/x)/dx = -c / x**2 from the input: the output form -y**2 / c is 0/0 = NaN for c == 0
        return _unary(functools.partial(_k_rdiv_scalar, c=c), x,
                      lambda op, dy: [_g2(functools.partial(_k_rdiv_grad, c=c), "rdiv_grad")(op.inputs[0], dy)],
                      "rdiv_scalar")
    if kind == "pow":
        return _unary(functools.partial(_k_pow_scalar, c=c), x,
                      lambda op, dy: [_g2(functools.partial(_k_pow_grad, c=c), "pow_grad")(op.inputs[0], dy)],
                      "pow_scalar")
    raise ValueError(f"scalar_op: unknown kind {kind!r}")

