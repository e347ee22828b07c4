"""Einsum by dimension name, and matmul.

Lowering (Mesh TF section 5, extended):

* each processor runs ``torch.einsum`` on its slices;
* a contracted dimension split over mesh axis ``a`` leaves partial sums: a deferred (lazy)
  all-reduce over ``a``, emitted only when a consumer needs the full value;
* if one mesh axis splits *different* dimensions in different operands (e.g. ``x[k:a]`` and
  ``y[c:a]``), the local products would pair the wrong slices. Mesh TF silently mis-computes
  or rejects such layouts; here the operands whose dimension is not kept split are all-gathered
  along it first (the kept one is the output's dimension on that axis, else the first seen).
"""

from __future__ import annotations

import functools
import math
import string

import torch

from meshtorch.core.dims import Shape, combine_shapes, convert_to_shape
from meshtorch.core.errors import ShapeError
from meshtorch.core.graph import Operation, Tensor
from meshtorch.ops._util import dim_names
from meshtorch.ops.shape import broadcast

_LETTERS = string.ascii_letters


class EinsumOperation(Operation):
    """``torch.einsum`` over named dims: inputs ``xs``, output ``output_shape``."""

    def __init__(self, xs, output_shape, name=None):
        super().__init__(xs, name=name or "einsum")
        self.outputs = [Tensor(self, output_shape, xs[0].dtype)]
        all_dims = combine_shapes([x.shape for x in xs], f"einsum {self.name!r}")
        if len(all_dims) > len(_LETTERS):
            raise ShapeError(f"einsum {self.name!r}: more than {len(_LETTERS)} distinct dimensions.")
        self._letters = {d.name: _LETTERS[i] for i, d in enumerate(all_dims)}
        self._all_dims = all_dims
        ins = ",".join("".join(self._letters[d.name] for d in x.shape) for x in xs)
        self.equation = ins + "->" + "".join(self._letters[d.name] for d in output_shape)

    @property
    def flops(self) -> int:
        """Multiply-add FLOPs of the whole einsum (2 per multiply-add; (n-1) products for n operands)."""
        return 2 * max(len(self.inputs) - 1, 1) * self._all_dims.size

    def lower(self, lw):
        out = self.outputs[0]
        axis_dims: dict[int, list[str]] = {}
        for t in [*self.inputs, out]:
            for d, a in zip(t.shape, lw.tensor_layout(t), strict=True):
                if a is not None and d.name not in axis_dims.setdefault(a, []):
                    axis_dims[a].append(d.name)
        kept = {}
        for a, names in axis_dims.items():
            in_out = [n for n in names if n in out.shape]
            kept[a] = in_out[0] if in_out else names[0]
        slots = []
        for x in self.inputs:
            s = lw.get(x)
            layout = tuple(lw.tensor_layout(x))
            gathered = tuple(None if a is not None and kept[a] != d.name else a
                             for d, a in zip(x.shape, layout, strict=True))
            if gathered != layout:
                s = lw.redistribute(s, x, layout, gathered)
            slots.append(s)
        reduced = frozenset(a for a, n in kept.items() if n not in out.shape)
        f = None
        if len(slots) == 2:
            f = _matmul_fn(*(x.shape.dimension_names for x in self.inputs), out.shape.dimension_names)
        if f is None:
            f = functools.partial(_k_einsum, equation=self.equation)
        lw.set(out, lw.slicewise(f, *slots, flops=self.flops), reduced)

    def gradient(self, grad_ys):
        dy = grad_ys[0]
        if dy is None:
            return [None] * len(self.inputs)
        grads = []
        for i, x in enumerate(self.inputs):
            others = [dy] + [t for j, t in enumerate(self.inputs) if j != i]
            avail = {d.name for t in others for d in t.shape}
            target = Shape([d for d in x.shape if d.name in avail])
            g = einsum(others, output_shape=target, name=f"{self.name}_grad{i}")
            grads.append(broadcast(g, x.shape) if target != x.shape else g)
        return grads


def _matmul_fn(a_names, b_names, out_names):
    """A two-operand einsum as one ``torch.matmul`` on permuted/reshaped slices, or None.

    Dims are grouped as batch (in a, b and the output), contracted (in a and b only), left (a
    and output) and right (b and output); a is viewed as ``[batch, left, contracted]``, b as
    ``[batch, contracted, right]``. The operands are swapped when that yields the output's dim
    order directly, so e.g. a weight gradient ``[batch, hidden] x [batch, rows, cols] ->
    [rows, cols, hidden]`` is one ``x^T @ dy`` with no copy of the result. ``torch.einsum``
    reaches the same BLAS call but may compute the transposed product and copy it; on the MNIST
    model's w1 gradient that cost ~1 ms a step. Returns None (use ``torch.einsum``) when a dim is
    summed within one operand only.
    """
    a_set, b_set, o_set = set(a_names), set(b_names), set(out_names)
    if any(n not in b_set and n not in o_set for n in a_names) or any(
            n not in a_set and n not in o_set for n in b_names):
        return None
    batch = [n for n in out_names if n in a_set and n in b_set]
    contract = [n for n in a_names if n in b_set and n not in o_set]
    left = [n for n in out_names if n in a_set and n not in b_set]
    right = [n for n in out_names if n in b_set and n not in a_set]
    swap = list(out_names) != batch + left + right and list(out_names) == batch + right + left
    if swap:
        a_names, b_names, left, right = b_names, a_names, right, left
    pa = [a_names.index(n) for n in batch + left + contract]
    pb = [b_names.index(n) for n in batch + contract + right]
    mid = batch + left + right
    po = [mid.index(n) for n in out_names]
    nb, nl, nk, nr = len(batch), len(left), len(contract), len(right)
    # views the kernel may skip (each is an aten call per step): an identity permute, and a reshape of a slice
    # already of the kernel's 2-D/3-D shape (one dim per group: e.g. [tokens, d_model] x [d_model, d_ff])
    shaped = (nb <= 1 and nl == 1 and nk == 1, nb <= 1 and nk == 1 and nr == 1, nb <= 1 and nl == 1 and nr == 1)
    return functools.partial(_k_matmul, swap=swap, pa=_perm_or_none(pa), pb=_perm_or_none(pb), po=_perm_or_none(po),
                             nb=nb, nl=nl, nk=nk, shaped=shaped)


def _perm_or_none(p):
    return None if p == list(range(len(p))) else tuple(p)


def _k_einsum(*xs, equation):
    return torch.einsum(equation, *xs)


def _k_matmul(a, b, *, swap, pa, pb, po, nb, nl, nk, shaped=(False, False, False)):
    """Kernel of :func:`_matmul_fn`: one ``torch.mm``/``torch.bmm`` on permuted, reshaped slices.

    ``pa``/``pb``/``po``: permutations (None: identity); ``shaped``: (a, b, the product) already have the
    shapes of the mm/bmm operands and of the result, so they need no reshape."""
    if swap:
        a, b = b, a
    if pa is not None:
        a = a.permute(pa)
    if pb is not None:
        b = b.permute(pb)
    bs, ls, ks, rs = a.shape[:nb], a.shape[nb:nb + nl], a.shape[nb + nl:], b.shape[nb + nk:]
    n_b, n_l, n_k, n_r = math.prod(bs), math.prod(ls), math.prod(ks), math.prod(rs)
    if nb:
        y = torch.bmm(a if shaped[0] else _flat(a, (n_b, n_l, n_k)), b if shaped[1] else _flat(b, (n_b, n_k, n_r)))
    else:
        y = torch.mm(a if shaped[0] else _flat(a, (n_l, n_k)), b if shaped[1] else _flat(b, (n_k, n_r)))
    if not shaped[2]:
        y = y.view((*bs, *ls, *rs))  # mm/bmm's result is contiguous: a view, never a copy
    return y if po is None else y.permute(po)


def _flat(t: torch.Tensor, shape) -> torch.Tensor:
    """``t.reshape(shape)`` as one ``aten::view`` when ``t`` is contiguous (``reshape`` dispatches to
    ``view``/``_reshape_alias`` itself: two aten calls per operand per step), else ``reshape`` (may copy)."""
    return t.view(shape) if t.is_contiguous() else t.reshape(shape)


def einsum(xs, output_shape=None, reduced_dims=None, name=None) -> Tensor:
    """Einstein summation by dimension name (Mesh TF ``mtf.einsum``).

    Args:
        xs: list of Tensors (same dtype).
        output_shape: the output's dims. If None: all dims minus ``reduced_dims`` when given, else
            the dims that appear in exactly one input (Mesh TF's inference), in first-seen order.
        reduced_dims: dims to contract (alternative to ``output_shape``).

    Returns:
        Tensor of ``output_shape``. Contracted split dims cost one (deferred) all-reduce.

    Raises:
        ShapeError: one name with two sizes among the inputs, or an output dim no input has.
    """
    if isinstance(xs, Tensor):
        xs = [xs]
    xs = list(xs)
    if not xs:
        raise ValueError("einsum needs at least one input.")
    for i, x in enumerate(xs):
        if not isinstance(x, Tensor):
            raise TypeError(f"einsum: input {i} is {type(x).__name__}, expected an mtf Tensor.")
    all_dims = combine_shapes([x.shape for x in xs], f"einsum {name or ''} of {[x.name for x in xs]}")
    if output_shape is None:
        if reduced_dims is not None:
            output_shape = all_dims - dim_names(reduced_dims)
        else:
            counts: dict[str, int] = {}
            for x in xs:
                for d in x.shape:
                    counts[d.name] = counts.get(d.name, 0) + 1
            output_shape = Shape([d for d in all_dims if counts[d.name] == 1])
    else:
        output_shape = convert_to_shape(output_shape)
        if reduced_dims is not None:
            raise ValueError("einsum: give output_shape or reduced_dims, not both.")
    for d in output_shape:
        if d.name not in all_dims:
            raise ShapeError(f"einsum {name or ''}: output dimension {d.name!r} appears in no input "
                             f"({[str(x.shape) for x in xs]}); use mtf.broadcast to add it.")
    combine_shapes([all_dims, output_shape], f"einsum {name or ''} output")
    return EinsumOperation(xs, output_shape, name).outputs[0]


def matmul(a: Tensor, b: Tensor, output_shape=None, reduced_dims=None, name=None) -> Tensor:
    """``einsum([a, b], ...)`` (Mesh TF ``mtf.matmul``): contracts the dims a and b share by default."""
    return einsum([a, b], output_shape=output_shape, reduced_dims=reduced_dims, name=name or "matmul")


_k_matmul.fresh_outputs = True  # a new tensor: in-place updates may follow it (meshtorch.lowering.donate)
