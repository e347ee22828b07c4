"""Hypothesis property tests: random named shapes, meshes and legal layouts for the elementwise, binary,
reduce and einsum families (and a chain einsum -> binary -> rename/reshape -> reduce), each compared with plain
PyTorch on full tensors, values and gradients.

Every example draws a small pool of named dims (sizes from {1,2,3,4,6,8}), tensor shapes as ordered
subsets of the pool, one mesh and a random *legal* layout for it (a dim may go on a mesh axis only if
its size divides by the axis size, and no tensor of the graph gets two dims on one axis; einsum and
chain layouts may put different dims of different operands on one axis). Values are drawn as normal
floats, small integers (ties and zeros, which exercise the max/min/relu/abs tie rules) or hypothesis
float32 arrays, and run in float32 or float64 (drawn). The gradient check differentiates
``sum(out * random cotangent)`` exactly as :func:`meshtorch.testing.check_layouts` does for the op suites
(its ``run_layout`` / ``reference_run``), with the error measure described at ``RTOL``. Each property runs
200 examples; ``derandomize=True`` keeps CI reproducible. ``--hypothesis-show-statistics`` prints how
often each mesh, split count, contracted split, shared mesh axis and lazy-sum case came up.
"""

import string

import numpy as np
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

import meshtorch as mtf
from meshtorch.testing import reference_run, run_layout

NAMES = ("b", "h", "k", "s", "d", "e")
SIZES = (4, 2, 8, 6, 3, 1)  # shrinks towards splittable sizes
MESHES = ("", "all:2", "all:4", "rows:2;cols:2", "x:3;y:2", "p:2;q:2;r:2")
SETTINGS = dict(max_examples=200, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ------------------------------------------------------------------ named-dim helpers for the references


def align(t: torch.Tensor, names, target) -> torch.Tensor:
    """Full tensor with dims ``names`` -> dims ``target`` order, size 1 where ``names`` lacks a dim."""
    names = list(names)
    perm = [names.index(n) for n in target if n in names]
    t = t.permute(perm) if perm else t
    for i, n in enumerate(target):
        if n not in names:
            t = t.unsqueeze(i)
    return t


def spec(names, sizes) -> str:
    """``"b:4,h:8"`` for names ``["b", "h"]`` (``""`` for a scalar)."""
    return ",".join(f"{n}:{sizes[n]}" for n in names)


# ------------------------------------------------------------------ strategies


@st.composite
def dim_pool(draw, min_dims=1, max_dims=4):
    names = draw(st.lists(st.sampled_from(NAMES), min_size=min_dims, max_size=max_dims, unique=True))
    return {n: draw(st.sampled_from(SIZES)) for n in names}


@st.composite
def ordered_subset(draw, names, min_size=0, max_size=None):
    """A random subset of ``names`` in random order."""
    names = list(names)
    max_size = len(names) if max_size is None else min(max_size, len(names))
    k = draw(st.integers(min(min_size, max_size), max_size))
    return draw(st.permutations(names))[:k]


def _legal(rules, name, axis, size, tensors) -> bool:
    """May ``name:axis`` join ``rules``: divisible, name not yet split, and no tensor gets ``axis`` twice?"""
    if size % axis.size or any(r[0] == name for r in rules):
        return False
    return not any(name in t and any(r[1] == axis.name and r[0] in t for r in rules) for t in tensors)


@st.composite
def mesh_and_layout(draw, sizes, tensors, mesh_shape=None, rules=()):
    """``(mesh_shape, layout)``: a mesh from MESHES and a legal layout for every tensor in ``tensors``.

    Starting from ``rules``, for each mesh axis and each tensor (in random order), usually put one of its
    dims on the axis if that is legal, so one axis can split different dims of different tensors when no
    single tensor holds two of them.
    """
    mesh_shape = draw(st.sampled_from(MESHES)) if mesh_shape is None else mesh_shape
    rules = list(rules)
    for axis in mtf.convert_to_shape(mesh_shape):
        for t in draw(st.permutations(tensors)):
            cands = [n for n in t if _legal(rules, n, axis, sizes[n], tensors)]
            if cands and draw(st.integers(0, 3)):
                rules.append((draw(st.sampled_from(cands)), axis.name))
    return mesh_shape, ";".join(f"{n}:{a}" for n, a in rules)


@st.composite
def values(draw, names, sizes, positive=False, hypothesis_floats=True):
    """A float32 tensor of dims ``names``: normal, small integers (ties, zeros) or hypothesis floats."""
    shape = [sizes[n] for n in names]
    numel = int(np.prod(shape, dtype=np.int64))
    kinds = ["normal", "ints"] + (["hypothesis"] if numel <= 64 and hypothesis_floats else [])
    kind = draw(st.sampled_from(kinds))
    if kind == "hypothesis":
        a = draw(arrays(np.float32, shape, elements=st.floats(-3, 3, width=32, allow_subnormal=False)))
        t = torch.from_numpy(np.ascontiguousarray(a)).reshape(shape)
    else:
        g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
        t = torch.randn(shape, generator=g) if kind == "normal" else torch.randint(-2, 3, shape, generator=g).float()
    return t.abs() + 0.5 if positive else t


# Inputs and cotangents are O(1), so float32 rounding errs by about (number of summed terms) * 6e-8 in absolute
# terms, and a sum that cancels to a small result (e.g. x.sum() * y.sum() + x @ z ~ 1e-3) is then off by far
# more than 1e-5 of *its* size. Errors are therefore measured relative to max(max |reference|, 1); a layout
# bug (a wrong slice, a missing or doubled all-reduce, a wrong tie rule) errs by O(1). float64 examples
# keep a tight bound, so small-valued outputs are still checked closely there.
RTOL = {torch.float32: 1e-4, torch.float64: 1e-9}


@st.composite
def dtype(draw):
    return draw(st.sampled_from([torch.float32, torch.float64]))


def _events(mesh_shape, layout, operands=(), out=()):
    """Label the example for ``--hypothesis-show-statistics``: mesh, splits, contracted splits, shared axes."""
    rules = [r.split(":") for r in layout.split(";") if r]
    event(f"mesh {mesh_shape or '1 processor'}: {len(rules)} split dim(s)")
    if any(n not in out and any(n in ns for ns in operands) for n, _ in rules):
        event("a split dim is contracted (deferred all-reduce)")
    axes = [a for _, a in rules]
    if len(set(axes)) < len(axes):
        event("one mesh axis splits different dims of different tensors")


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().to(torch.float64), b.detach().to(torch.float64)
    if a.numel() == 0:
        return 0.0
    return ((a - b).abs().max() / b.abs().max().clamp_min(1.0)).item()


def _check(build, inputs, reference, mesh_shape, layout, dt=torch.float32, grad=True):
    """Like :func:`meshtorch.testing.check_layouts` on one layout, with the error measure above."""
    inputs = {k: (s, v.to(dt)) for k, (s, v) in inputs.items()}
    outs, grads, _ = run_layout(build, inputs, mesh_shape, layout, grad=grad)
    ref_outs, ref_grads = reference_run(reference, inputs, [o.dtype for o in outs], grad=grad)
    where = f"mesh {mesh_shape!r} layout {layout!r} {dt}"
    assert len(outs) == len(ref_outs)
    for o, r in zip(outs, ref_outs, strict=True):
        assert tuple(o.shape) == tuple(r.shape) and o.dtype == r.dtype, f"{where}: {o.shape} {o.dtype} vs {r.shape}"
        if o.dtype.is_floating_point:
            assert _err(o, r) <= RTOL[dt], f"{where}: output error {_err(o, r):.3g}\n{o}\n{r}"
        else:
            assert torch.equal(o, r), f"{where}: output differs\n{o}\n{r}"
    assert set(grads) == set(ref_grads), f"{where}: gradients for {set(grads)} vs reference {set(ref_grads)}"
    for n, g in grads.items():
        assert _err(g, ref_grads[n]) <= RTOL[dt], f"{where}: gradient of {n!r} error {_err(g, ref_grads[n]):.3g}"


# ------------------------------------------------------------------ 1. unary elementwise

# name -> (mtf fn, torch reference, needs positive input, has gradient)
UNARY = {
    "relu": (mtf.relu, torch.relu, False, True),
    "exp": (mtf.exp, torch.exp, False, True),
    "log": (mtf.log, torch.log, True, True),
    "sqrt": (mtf.sqrt, torch.sqrt, True, True),
    "rsqrt": (mtf.rsqrt, torch.rsqrt, True, True),
    "tanh": (mtf.tanh, torch.tanh, False, True),
    "sigmoid": (mtf.sigmoid, torch.sigmoid, False, True),
    "gelu": (mtf.gelu, torch.nn.functional.gelu, False, True),
    "gelu_tanh": (lambda x: mtf.gelu(x, approximate="tanh"),
                  lambda x: torch.nn.functional.gelu(x, approximate="tanh"), False, True),
    "square": (mtf.square, torch.square, False, True),
    "negative": (mtf.negative, torch.neg, False, True),
    "neg_operator": (lambda x: -x, lambda x: -x, False, True),
    "reciprocal": (mtf.reciprocal, torch.reciprocal, True, True),
    "abs": (mtf.abs, torch.abs, False, True),
    "sign": (mtf.sign, torch.sign, False, False),
    "identity": (mtf.identity, lambda x: x * 1, False, True),
    "stop_gradient": (mtf.stop_gradient, lambda x: x.detach(), False, True),
    "cast_float64": (lambda x: mtf.cast(x, torch.float64), lambda x: x.double(), False, True),
    "add_scalar": (lambda x: x + 1.5, lambda x: x + 1.5, False, True),
    "radd_int": (lambda x: 2 + x, lambda x: 2 + x, False, True),
    "sub_scalar": (lambda x: x - 0.25, lambda x: x - 0.25, False, True),
    "rsub_scalar": (lambda x: 3.0 - x, lambda x: 3.0 - x, False, True),
    "mul_scalar": (lambda x: x * -2.5, lambda x: x * -2.5, False, True),
    "div_scalar": (lambda x: x / 4.0, lambda x: x / 4.0, False, True),
    "rdiv_scalar": (lambda x: 2.0 / x, lambda x: 2.0 / x, True, True),
    "pow2": (lambda x: x ** 2, lambda x: x ** 2, False, True),
    "pow3": (lambda x: x ** 3, lambda x: x ** 3, False, True),
    "pow_half": (lambda x: x ** 0.5, lambda x: x ** 0.5, True, True),
}


@st.composite
def unary_problem(draw):
    sizes = draw(dim_pool(0, 4))
    names = draw(st.permutations(list(sizes)))
    op = draw(st.sampled_from(sorted(UNARY)))
    mesh_shape, layout = draw(mesh_and_layout(sizes, [names]))
    x = draw(values(names, sizes, positive=UNARY[op][2]))
    return op, spec(names, sizes), x, mesh_shape, layout


@settings(**SETTINGS)
@given(unary_problem(), dtype())
def test_unary_random_shapes_and_layouts(problem, dt):
    op, shape, x, mesh_shape, layout = problem
    _events(mesh_shape, layout)
    fn, ref, _, grad = UNARY[op]
    _check(lambda mesh, x: fn(x), {"x": (shape, x)}, ref, mesh_shape, layout, dt, grad=grad)


# ------------------------------------------------------------------ 2. binary broadcasting

# name -> (mtf fn, torch fn, y positive, float output with gradient)
BINARY = {
    "add": (mtf.add, torch.add, False, True),
    "add_operator": (lambda x, y: x + y, torch.add, False, True),
    "subtract": (mtf.subtract, torch.sub, False, True),
    "multiply": (mtf.multiply, torch.mul, False, True),
    "divide": (mtf.divide, torch.div, True, True),
    "maximum": (mtf.maximum, torch.maximum, False, True),
    "minimum": (mtf.minimum, torch.minimum, False, True),
    "greater": (mtf.greater, torch.gt, False, False),
    "equal": (mtf.equal, torch.eq, False, False),
    "less_equal": (mtf.less_equal, torch.le, False, False),
}


@st.composite
def binary_problem(draw):
    """x op y with random, partly overlapping shapes; sometimes y is a Python scalar on either side."""
    sizes = draw(dim_pool(2, 4))
    op = draw(st.sampled_from(sorted(BINARY)))
    side = draw(st.sampled_from([None, None, "right", "left"]))  # where a Python scalar operand goes
    xn = draw(ordered_subset(list(sizes), min_size=2 if side else 0))
    yn = [] if side else draw(ordered_subset(list(sizes)))
    union = xn + [n for n in yn if n not in xn]  # Mesh TF: x's dims, then y's new dims
    out = None if op == "add_operator" else draw(st.one_of(st.none(), st.permutations(union)))
    mesh_shape, layout = draw(mesh_and_layout(sizes, [xn, yn, union]))
    x = draw(values(xn, sizes, positive=side == "left" and BINARY[op][2]))
    y = draw(st.sampled_from([0.0, 0.5, -1.0, 2.0])) if side else draw(values(yn, sizes, positive=BINARY[op][2]))
    if side == "right" and BINARY[op][2]:
        y = 2.0
    return op, side, sizes, xn, yn, union, out, x, y, mesh_shape, layout


@settings(**SETTINGS)
@given(binary_problem(), dtype())
def test_binary_broadcast_random_shapes_and_layouts(problem, dt):
    op, side, sizes, xn, yn, union, out, x, y, mesh_shape, layout = problem
    _events(mesh_shape, layout)
    event(f"scalar operand: {side}, output_shape given: {out is not None}")
    fn, tfn, _, grad = BINARY[op]
    target = union if out is None else list(out)
    kw = {} if out is None else {"output_shape": spec(out, sizes)}

    def build(mesh, x, y=None):
        z = fn(x, y, **kw) if side is None else fn(x, c, **kw) if side == "right" else fn(c, x, **kw)
        assert list(z.shape.dimension_names) == target, (op, side, z.shape, target)
        return z

    def reference(x, y=None):
        x = align(x, xn, target)
        if side is None:
            y = align(y, yn, target)
        else:
            x, y = (x, torch.tensor(c, dtype=x.dtype)) if side == "right" else (torch.tensor(c, dtype=x.dtype), x)
        return tfn(x, y).expand([sizes[n] for n in target])

    inputs = {"x": (spec(xn, sizes), x)}
    if side is None:
        inputs["y"] = (spec(yn, sizes), y)
    c = y
    _check(build, inputs, reference, mesh_shape, layout, dt, grad=grad)


# ------------------------------------------------------------------ 3. reductions

REDUCE = {
    "sum": (mtf.reduce_sum, lambda x, d: x.sum(d)),
    "mean": (mtf.reduce_mean, lambda x, d: x.mean(d)),
    "max": (mtf.reduce_max, lambda x, d: x.amax(d)),
    "min": (mtf.reduce_min, lambda x, d: x.amin(d)),
    "logsumexp": (mtf.reduce_logsumexp, lambda x, d: torch.logsumexp(x, d)),
}


@st.composite
def reduce_problem(draw):
    sizes = draw(dim_pool(1, 4))
    xn = draw(st.permutations(list(sizes)))
    op = draw(st.sampled_from([*sorted(REDUCE), "softmax", "log_softmax"]))
    if op in ("softmax", "log_softmax"):
        out = [draw(st.sampled_from(xn))]  # the softmax dim
        tensors = [xn, [n for n in xn if n not in out]]
    else:
        out = draw(ordered_subset(xn))
        tensors = [xn, out]
    mesh_shape, layout = draw(mesh_and_layout(sizes, tensors))
    return op, sizes, xn, out, draw(values(xn, sizes)), mesh_shape, layout


@settings(**SETTINGS)
@given(reduce_problem(), dtype())
def test_reduce_random_subsets_and_layouts(problem, dt):
    op, sizes, xn, out, x, mesh_shape, layout = problem
    _events(mesh_shape, layout, [xn], out)
    if op in ("softmax", "log_softmax"):
        fn = mtf.softmax if op == "softmax" else mtf.log_softmax
        i = xn.index(out[0])
        tfn = torch.softmax if op == "softmax" else torch.log_softmax
        _check(lambda mesh, x: fn(x, out[0]), {"x": (spec(xn, sizes), x)}, lambda x: tfn(x, i), mesh_shape, layout, dt)
        return
    fn, tfn = REDUCE[op]
    reduced = tuple(i for i, n in enumerate(xn) if n not in out)

    def reference(x):
        r = tfn(x, reduced) if reduced else x  # torch reads dim=() as "all dims"
        return align(r, [n for n in xn if n in out], out)

    _check(lambda mesh, x: fn(x, output_shape=spec(out, sizes)), {"x": (spec(xn, sizes), x)}, reference,
           mesh_shape, layout, dt)


# ------------------------------------------------------------------ 4. einsum


def torch_einsum(operand_names, out_names, *ts):
    letters = {}
    for n in [*(n for ns in operand_names for n in ns), *out_names]:
        letters.setdefault(n, string.ascii_letters[len(letters)])
    ins = ",".join("".join(letters[n] for n in ns) for ns in operand_names)
    eq = ins + "->" + "".join(letters[n] for n in out_names)
    return torch.einsum(eq, *ts)


@st.composite
def with_dim(draw, names, must, max_size=3):
    """An ordered subset of ``names`` (at most ``max_size``) that holds ``must``."""
    rest = draw(ordered_subset([n for n in names if n != must], max_size=max_size - 1))
    i = draw(st.integers(0, len(rest)))
    return [*rest[:i], must, *rest[i:]]


@st.composite
def einsum_problem(draw):
    """1-3 operands over a shared dim pool, output a random ordered subset of their union.

    In about half the examples one mesh axis is made to split a dim ``a`` of the first operand and a
    different dim ``b`` of the last (no tensor holds both): the lowering must all-gather one of them, since
    a local einsum of the slices would pair the wrong ones (Mesh TF mis-computes or rejects this).
    """
    shared = draw(st.booleans())
    sizes = draw(dim_pool(2 if shared else 1, 4))
    k = draw(st.integers(2 if shared else 1, 3))
    names = list(sizes)
    if shared:
        a, b = draw(st.permutations(names))[:2]
        first = draw(with_dim([n for n in names if n != b], a))
        last = draw(with_dim([n for n in names if n != a], b))
        drop = draw(st.sampled_from([a, b]))  # the middle operand may hold one of a, b, not both
        middle = [draw(ordered_subset([n for n in names if n != drop], max_size=3))]
        operands = [first, *middle[: k - 2], last]
    else:
        operands = [draw(ordered_subset(names, max_size=3)) for _ in range(k)]
    union = list(dict.fromkeys(n for ns in operands for n in ns))
    # output_shape given, or Mesh TF's inference (dims in exactly one operand), or reduced_dims
    mode = draw(st.sampled_from(["output_shape", "output_shape", "inferred", "reduced_dims"]))
    if mode == "inferred":
        out = [n for n in union if sum(n in ns for ns in operands) == 1]
    elif mode == "reduced_dims":
        reduced = draw(ordered_subset(union))
        out = [n for n in union if n not in reduced]
    else:
        out = draw(ordered_subset(union))
    mesh_shape, rules = None, []
    if shared:
        if a in out and b in out:
            mode = "output_shape"
            out.remove(draw(st.sampled_from([a, b])))
        mesh_shape = draw(st.sampled_from(MESHES[1:]))
        axis = mtf.convert_to_shape(mesh_shape)[0]
        for n in (a, b):
            sizes[n] = axis.size * draw(st.sampled_from([1, 2]))
        rules = [(a, axis.name), (b, axis.name)]
    mesh_shape, layout = draw(mesh_and_layout(sizes, [*operands, out], mesh_shape, rules))
    xs = [draw(values(ns, sizes)) for ns in operands]
    return sizes, operands, mode, out, xs, mesh_shape, layout


@settings(**SETTINGS)
@given(einsum_problem(), dtype())
def test_einsum_random_operands_and_layouts(problem, dt):
    sizes, operands, mode, out, xs, mesh_shape, layout = problem
    _events(mesh_shape, layout, operands, out)
    event(f"einsum {mode}")
    names = [f"x{i}" for i in range(len(xs))]

    def build(mesh, **ts):
        xs = [ts[n] for n in names]
        if mode == "inferred":
            return mtf.einsum(xs)
        if mode == "reduced_dims":
            return mtf.einsum(xs, reduced_dims=[n for n in sizes if n not in out and any(n in o for o in operands)])
        return mtf.einsum(xs, output_shape=spec(out, sizes))

    def reference(**ts):
        return torch_einsum(operands, out, *[ts[n] for n in names])

    inputs = {n: (spec(ns, sizes), x) for n, ns, x in zip(names, operands, xs, strict=True)}
    _check(build, inputs, reference, mesh_shape, layout, dt)


# ------------------------------------------------------------------ 5. chain: lazy all-reduce through ops

# linear ops may keep a pending all-reduce lazy; affine and non-linear ones must force it first (square, not
# tanh: tanh saturates on these sums and its float32 gradient 1 - tanh**2 is then pure rounding)
MIDDLE = ("add_einsum", "sub_einsum", "add_tensor", "mul_scalar", "div_scalar", "negative", "identity", "add_scalar",
          "square", "none")
FINAL = ("reduce_sum", "reduce_max", "reduce_mean", "none")


@st.composite
def chain_problem(draw):
    """e1 = einsum(x, y) -> middle op (with e2 = einsum(x, z) or w) -> rename or reshape -> final reduce.

    The rename (a dim to ``r``) or reshape (two adjacent dims merged into ``m``) moves a possibly split,
    possibly still lazily summed dim: the reshape lowering must gather, slice or keep it correctly.
    """
    sizes = draw(dim_pool(2, 4))
    names = list(sizes)
    contracted = draw(st.sampled_from([None, *names]))  # a dim of x that neither e1 nor e2 keeps
    sn = draw(ordered_subset([n for n in names if n != contracted], min_size=1, max_size=3))
    xn = draw(ordered_subset([n for n in names if n != contracted], max_size=2))
    xn = draw(st.permutations(xn + [contracted])) if contracted else xn
    yn, zn = (draw(st.permutations(list(dict.fromkeys([n for n in sn if n not in xn]
                                                      + draw(ordered_subset(names, max_size=1))))))
              for _ in range(2))  # e1 = einsum(x, y) and e2 = einsum(x, z) can both have e1's dims sn
    mesh_shape, rules = None, []
    if contracted and draw(st.integers(0, 3)):  # usually split it: e1, e2 are lazy sums over one mesh axis
        mesh_shape = draw(st.sampled_from(MESHES[1:]))
        axis = mtf.convert_to_shape(mesh_shape)[0]
        sizes[contracted] = axis.size * draw(st.sampled_from([1, 2]))
        rules = [(contracted, axis.name)]
        others = [n for n in names if n not in sn and n not in xn and n not in yn]
        if len(mtf.convert_to_shape(mesh_shape)) > 1 and others and draw(st.booleans()):
            # z alone contracts a dim split over a second axis: e2 is lazy over more axes than e1
            extra, axis2 = draw(st.sampled_from(others)), mtf.convert_to_shape(mesh_shape)[1]
            zn = draw(st.permutations([*zn, extra])) if extra not in zn else zn
            sizes[extra] = axis2.size * draw(st.sampled_from([1, 2]))
            rules.append((extra, axis2.name))
    middle = draw(st.sampled_from(("add_einsum", "sub_einsum", *MIDDLE)))  # sums of lazy sums twice as often
    wn = draw(ordered_subset(sn))
    e2n = draw(st.permutations(sn))  # e2's dim order: the sum of two lazy sums stays lazy only if aligned
    if e2n == sn and draw(st.integers(0, 2)):
        e2n = sn[::-1]
    post = draw(st.sampled_from([None, "rename", "merge"] if len(sn) > 1 else [None, "rename"] if sn else [None]))
    if post == "rename":
        i = draw(st.integers(0, len(sn) - 1))
        sn2, sizes = [*sn[:i], "r", *sn[i + 1:]], {**sizes, "r": sizes[sn[i]]}
    elif post == "merge":
        i = draw(st.integers(0, len(sn) - 2))
        sn2, sizes = [*sn[:i], "m", *sn[i + 2:]], {**sizes, "m": sizes[sn[i]] * sizes[sn[i + 1]]}
    else:
        sn2 = sn
    final = draw(st.sampled_from(FINAL))
    rn = draw(ordered_subset(sn2)) if final != "none" else sn2
    tensors = [xn, yn, zn, sn, wn, sn2, rn]
    mesh_shape, layout = draw(mesh_and_layout(sizes, tensors, mesh_shape, rules))
    # no hypothesis floats: their ties could be broken differently by two summation orders before reduce_max
    vals = {k: draw(values(ns, sizes, hypothesis_floats=False))
            for k, ns in (("x", xn), ("y", yn), ("z", zn), ("w", wn))}
    return sizes, dict(x=xn, y=yn, z=zn, w=wn, e2=e2n), sn, middle, post, sn2, final, rn, vals, mesh_shape, layout


def _apply_final(final, t, names, out):
    reduced = tuple(i for i, n in enumerate(names) if n not in out)
    if final == "none" or not reduced:
        r = t
    elif final == "reduce_sum":
        r = t.sum(reduced)
    elif final == "reduce_max":
        r = t.amax(reduced)
    else:
        r = t.mean(reduced)
    return align(r, [n for n in names if n in out], out)


@settings(**SETTINGS)
@given(chain_problem(), dtype())
def test_chain_einsum_binary_reduce(problem, dt):
    sizes, nm, sn, middle, post, sn2, final, rn, vals, mesh_shape, layout = problem
    _events(mesh_shape, layout, [nm["x"], nm["y"]], sn)
    event(f"middle {middle}, then {post}, final {final}")
    rules = dict(r.split(":") for r in layout.split(";") if r)
    kept_axes = {rules[n] for n in sn if n in rules}  # an axis that splits an output dim gathers the others
    lazy = [{rules[d] for d in {*nm["x"], *nm[o]} if d in rules and d not in sn and rules[d] not in kept_axes}
            for o in "yz"]
    if middle in ("add_einsum", "sub_einsum") and lazy[0] and lazy[0] == lazy[1]:
        event(f"e1 {middle[:3]} e2, both lazy over one mesh axis set, {'' if nm['e2'] == sn else 'not '}aligned")
    if middle in ("add_einsum", "sub_einsum") and lazy[0] and lazy[1] and lazy[0] != lazy[1]:
        event("e1 and e2 lazy over different mesh axes")
    s = spec(sn, sizes)

    def build(mesh, x, y, z=None, w=None):
        t = mtf.einsum([x, y], output_shape=s)
        if middle in ("add_einsum", "sub_einsum"):
            e2 = mtf.einsum([x, z], output_shape=spec(nm["e2"], sizes))
            t = t + e2 if middle == "add_einsum" else t - e2
        elif middle == "add_tensor":
            t = mtf.add(t, w)
        elif middle == "mul_scalar":
            t = t * 0.5
        elif middle == "div_scalar":
            t = t / 4.0
        elif middle == "negative":
            t = -t
        elif middle == "identity":
            t = mtf.identity(t)
        elif middle == "add_scalar":
            t = t + 1.0
        elif middle == "square":
            t = mtf.square(t)
        if post == "rename":
            t = mtf.rename_dimension(t, next(n for n in sn if n not in sn2), "r")
        elif post == "merge":
            t = mtf.reshape(t, spec(sn2, sizes))
        if final == "none":
            return t
        return getattr(mtf, final)(t, output_shape=spec(rn, sizes))

    def reference(x, y, z=None, w=None):
        t = torch_einsum([nm["x"], nm["y"]], sn, x, y)
        if middle in ("add_einsum", "sub_einsum"):
            e2 = torch_einsum([nm["x"], nm["z"]], sn, x, z)
            t = t + e2 if middle == "add_einsum" else t - e2
        elif middle == "add_tensor":
            t = t + align(w, nm["w"], sn)
        elif middle == "mul_scalar":
            t = t * 0.5
        elif middle == "div_scalar":
            t = t / 4.0
        elif middle == "negative":
            t = -t
        elif middle == "add_scalar":
            t = t + 1.0
        elif middle == "square":
            t = torch.square(t)
        t = t.reshape([sizes[n] for n in sn2])
        return _apply_final(final, t, sn2, rn)

    # only the inputs the graph uses (an unused one has no mtf gradient but a zero torch one)
    used = ["x", "y"] + (["z"] if middle in ("add_einsum", "sub_einsum") else []) + (["w"] if middle == "add_tensor"
                                                                                      else [])
    inputs = {k: (spec(nm[k], sizes), vals[k]) for k in used}
    _check(build, inputs, reference, mesh_shape, layout, dt)
