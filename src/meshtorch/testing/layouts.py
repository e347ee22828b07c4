"""Layout-invariance checking: run one graph under many meshes and layouts, compare to PyTorch.

``check_layouts`` (re-exported by :mod:`meshtorch.testing`) is the project's shared test helper
(and usable by anyone writing an op): it builds the graph once per layout, runs it on a
PlacementMeshImpl, and compares values *and* gradients with the same computation done by plain
PyTorch autograd on full tensors.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

import meshtorch as mtf
from meshtorch.core.dims import convert_to_shape

DEFAULT_MESHES = ("", "all:4", "rows:2;cols:2")


@dataclass
class OpCase:
    """One op-suite entry: a graph builder, its inputs and an unsplit PyTorch reference.

    Every ``tests/test_ops_*.py`` module lists its cases in a module-level ``OP_CASES`` so that the
    same graphs run on the placement mesh and, under torchrun/gloo, on the SPMD mesh.
    """

    name: str
    build: Callable
    inputs: dict  # {name: (shape, full torch.Tensor)}
    reference: Callable
    grad: bool = True
    rtol: float = 1e-5
    exclude: tuple = ()  # dims never to split for this case

    def check(self, layouts=None) -> list:
        return check_layouts(self.build, self.inputs, self.reference, layouts=layouts, grad=self.grad,
                             rtol=self.rtol, exclude=self.exclude)


def _graph_dims(build, inputs, seed):
    g = mtf.Graph(seed=seed)
    mesh = mtf.Mesh(g, "mesh")
    _make_inputs(mesh, inputs)
    build_outputs(build, mesh, _make_inputs.last)
    sizes, unsplittable = {}, set()
    for op in g.operations:
        unsplittable.update(op.unsplittable_dims)
        for t in [*op.inputs, *op.outputs]:
            for d in t.shape:
                sizes.setdefault(d.name, set()).add(d.size)
    return sizes, unsplittable


def _make_inputs(mesh, inputs):
    tensors = {}
    for name, (shape, value) in inputs.items():
        shape = convert_to_shape(shape)
        if value.dtype.is_floating_point:
            tensors[name] = mtf.get_variable(mesh, name, shape, initializer=0.0, dtype=value.dtype)
        else:
            tensors[name] = mtf.placeholder(mesh, name, shape, dtype=value.dtype)
    _make_inputs.last = tensors
    return tensors


def build_outputs(build, mesh, tensors):
    out = build(mesh, **tensors)
    return list(out) if isinstance(out, list | tuple) else [out]


def enumerate_layouts(build, inputs, meshes=DEFAULT_MESHES, seed=0, max_pairs=12, exclude=()):
    """``[(mesh_shape, layout)]``: one processor; each legal single split on ``all:4``; pairs on 2x2.

    A dim is a candidate for a mesh axis of size n if every tensor's size for it divides by n and no
    op of the graph declares it unsplittable (and it is not in ``exclude``).
    """
    sizes, unsplittable = _graph_dims(build, inputs, seed)
    bad = unsplittable | set(exclude)
    out = []
    for m in meshes:
        ms = convert_to_shape(m)
        if ms.ndims == 0:
            out.append((m, ""))
        elif ms.ndims == 1:
            n, ax = ms[0].size, ms[0].name
            out += [(m, f"{d}:{ax}") for d, s in sizes.items() if d not in bad and all(x % n == 0 for x in s)]
        else:
            cands = [[d for d, s in sizes.items() if d not in bad and all(x % a.size == 0 for x in s)] for a in ms]
            pairs = [(d1, d2) for d1, d2 in itertools.product(*cands[:2]) if d1 != d2][:max_pairs]
            out += [(m, f"{d1}:{ms[0].name};{d2}:{ms[1].name}") for d1, d2 in pairs]
    return out


def run_layout(build, inputs, mesh_shape, layout, grad=True, seed=0, cotangent_seed=1234, make_impl=None,
               roundtrip=None):
    """Build and run once; returns (outputs, {input name: gradient or None}, lowering).

    ``make_impl(mesh_shape, layout) -> MeshImpl`` (default ``PlacementMeshImpl``) picks the implementation.
    ``roundtrip``: ``"serialize"`` also writes the program as JSON (every step must be data);
    ``"run"`` also reads that JSON back, runs it in a fresh session on a fresh implementation
    with the same variable values and the other executor (the step interpreter instead of the
    generated function), and asserts bitwise-equal results.
    """
    g = mtf.Graph(seed=seed)
    mesh = mtf.Mesh(g, "mesh")
    tensors = _make_inputs(mesh, inputs)
    outs = build_outputs(build, mesh, tensors)
    fetches = list(outs)
    grad_names = []
    if grad:
        gen = torch.Generator().manual_seed(cotangent_seed)
        loss = None
        for i, o in enumerate(outs):
            if not o.dtype.is_floating_point:
                continue
            cot = torch.randn(o.shape.to_integer_list(), generator=gen, dtype=torch.float64).to(o.dtype)
            term = mtf.reduce_sum(o * mtf.import_tensor(mesh, cot, o.shape, name=f"cotangent{i}"))
            loss = term if loss is None else loss + term
        grad_names = [n for n, t in tensors.items() if t.dtype.is_floating_point]
        if loss is not None and grad_names:
            grads = mtf.gradients([loss], [tensors[n] for n in grad_names])
            fetches += [gr for gr in grads if gr is not None]
            grad_names = [n for n, gr in zip(grad_names, grads, strict=True) if gr is not None]
        else:
            grad_names = []
    lw = mtf.Lowering(g, {mesh: (make_impl or mtf.PlacementMeshImpl)(mesh_shape, layout)})
    for n, (_, v) in inputs.items():
        if v.dtype.is_floating_point:
            lw.set_variable_value(n, v)
    feeds = {tensors[n]: v for n, (_, v) in inputs.items() if not v.dtype.is_floating_point}
    res = lw.run(fetches, feeds=feeds)
    if roundtrip:
        text = lw.to_json(fetches)
        if roundtrip == "run":
            again = run_program_json(text, {mesh.name: (make_impl or mtf.PlacementMeshImpl)(mesh_shape, layout)},
                                     {n: lw.variable_value(n) for n in lw.variable_names},
                                     {t.name: v for t, v in feeds.items()}, [t.name for t in fetches])
            for i, (a, b) in enumerate(zip(res, again, strict=True)):
                assert torch.equal(a, b), f"mesh {mesh_shape!r} layout {layout!r}: fetch {i} differs after JSON"
    return res[: len(outs)], dict(zip(grad_names, res[len(outs):], strict=True)), lw


def run_program_json(text: str, impls: dict, variables: dict, feeds: dict, fetches: list,
                     mode: str = "interpret") -> list:
    """Run a serialised program (``Lowering.to_json``) once on ``{mesh name: MeshImpl}``.

    ``variables``: ``{name: full tensor}``; ``feeds``: ``{placeholder name: full tensor}``;
    ``fetches``: tensor names; ``mode``: the session's executor. Returns the fetched full tensors.
    No graph is needed: only the program's JSON text, as another process would receive it.
    """
    program = mtf.Program.from_json(text)
    store = mtf.VariableStore(program, impls)
    for n, v in variables.items():
        store.set_value(n, v)
    session = mtf.Session(program, impls, store, mode)
    return session.run(tuple(("tensor", n) for n in fetches), feeds)


def reference_run(reference, inputs, out_dtypes, grad=True, cotangent_seed=1234):
    """Plain PyTorch: outputs and autograd gradients w.r.t. the float inputs."""
    leaves = {}
    for n, (_, v) in inputs.items():
        leaves[n] = v.detach().clone().requires_grad_(grad and v.dtype.is_floating_point)
    outs = reference(**leaves)
    outs = list(outs) if isinstance(outs, list | tuple) else [outs]
    grads = {}
    if grad:
        gen = torch.Generator().manual_seed(cotangent_seed)
        loss = None
        for o in outs:
            if not o.dtype.is_floating_point:
                continue
            cot = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype)
            term = (o * cot).sum()
            loss = term if loss is None else loss + term
        float_leaves = {n: v for n, v in leaves.items() if v.requires_grad}
        if loss is not None and float_leaves and loss.requires_grad:
            gs = torch.autograd.grad(loss, list(float_leaves.values()), allow_unused=True)
            grads = {n: (torch.zeros_like(v) if g is None else g) for (n, v), g in
                     zip(float_leaves.items(), gs, strict=True)}
    return [o.detach() for o in outs], grads


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max(max |b|, 1e-6), in float64."""
    a, b = a.detach().to(torch.float64), b.detach().to(torch.float64)
    if a.numel() == 0:
        return 0.0
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()


def check_layouts(build: Callable, inputs: dict, reference: Callable, layouts=None, grad=True,
                  rtol=1e-5, seed=0, exclude=(), min_layouts=3) -> list:
    """Assert that ``build`` gives ``reference``'s values and gradients under every layout.

    Args:
        build: ``build(mesh, **tensors) -> Tensor | list``: float inputs arrive as variables (set to
            the given values), integer inputs as placeholders (fed).
        inputs: ``{name: (shape, full torch.Tensor)}``.
        reference: ``reference(**torch tensors) -> torch.Tensor | list``, outputs in the same dim
            order as the mtf outputs' shapes.
        layouts: ``[(mesh_shape, layout)]``; default :func:`enumerate_layouts`.
        grad: also compare gradients of ``sum(out * random cotangent)`` w.r.t. float inputs.
        rtol: tolerance on :func:`rel_error`.
        min_layouts: fail if fewer layouts were enumerated (guards against a vacuous test).

    Returns:
        the list of layouts checked.
    """
    layouts = list(layouts) if layouts is not None else enumerate_layouts(build, inputs, seed=seed, exclude=exclude)
    assert len(layouts) >= min_layouts, f"only {len(layouts)} layouts to check: {layouts}"
    ref_outs = ref_grads = None
    for k, (mesh_shape, layout) in enumerate(layouts):
        # every program must be data; the last one is also re-run from its JSON
        roundtrip = "run" if k == len(layouts) - 1 else "serialize"
        outs, grads, _ = run_layout(build, inputs, mesh_shape, layout, grad=grad, seed=seed, roundtrip=roundtrip)
        if ref_outs is None:
            ref_outs, ref_grads = reference_run(reference, inputs, [o.dtype for o in outs], grad=grad)
            assert len(ref_outs) == len(outs), "reference and graph give different numbers of outputs"
        where = f"mesh {mesh_shape!r} layout {layout!r}"
        for i, (o, r) in enumerate(zip(outs, ref_outs, strict=True)):
            assert tuple(o.shape) == tuple(r.shape), f"{where}: output {i} shape {tuple(o.shape)} != {tuple(r.shape)}"
            if o.dtype.is_floating_point:
                err = rel_error(o, r)
                assert err <= rtol, f"{where}: output {i} relative error {err:.3g} > {rtol}"
            else:
                assert torch.equal(o, r.to(o.dtype)), f"{where}: output {i} differs from the reference"
        if grad:
            assert set(grads) == set(ref_grads), f"{where}: gradients for {set(grads)} vs reference {set(ref_grads)}"
            for n, gr in grads.items():
                err = rel_error(gr, ref_grads[n])
                assert err <= rtol, f"{where}: gradient of {n!r} relative error {err:.3g} > {rtol}"
    return layouts


def assert_training_agrees(build: Callable, layouts, batches: Callable, steps: int, rtol: float,
                           ends: int = 2) -> dict:
    """Train one model per layout and assert that the step losses agree (and that training works).

    Args:
        build: ``build() -> model`` with ``.lowering(mesh_shape, layout)``, ``.loss``, ``.updates``,
            ``.inputs``, ``.targets`` (e.g. :func:`meshtorch.models.transformer.build_lm`).
        layouts: ``[(mesh_shape, layout)]``; the first is the reference.
        batches: ``batches(step) -> (inputs, targets)`` full tensors.
        steps: training steps per layout.
        rtol: largest allowed relative difference of any step loss from the reference's.
        ends: the mean of the last ``ends`` losses must be below the mean of the first ``ends``.

    Returns:
        ``{layout: float64 tensor of step losses}``.
    """
    losses = {}
    for mesh_shape, layout in layouts:
        m = build()
        lw = m.lowering(mesh_shape, layout)
        run = []
        for step in range(steps):
            x, y = batches(step)
            run.append(lw.run([m.loss] + m.updates, feeds={m.inputs: x, m.targets: y})[0].item())
        losses[(mesh_shape, layout)] = torch.tensor(run, dtype=torch.float64)
    base = losses[tuple(layouts[0])]
    assert base[-ends:].mean() < base[:ends].mean(), f"training did not reduce the loss: {base.tolist()}"
    for key, ls in losses.items():
        rel = ((ls - base).abs() / base.abs()).max().item()
        assert rel <= rtol, f"mesh {key[0]!r} layout {key[1]!r}: max relative loss difference {rel:.2e} > {rtol}"
    return losses
