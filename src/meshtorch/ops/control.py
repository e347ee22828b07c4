"""Control flow and autodiff helpers: while_loop, custom_gradient, depend, Print.

Follows Mesh TensorFlow's ``mtf.while_loop``, ``mtf.custom_gradient``, ``mtf.depend`` and ``mtf.Print``
(mesh_tensorflow/ops.py). ``mtf.recompute_grad`` (custom_gradient with a gradient function that calls
``gradients``) lives in :mod:`meshtorch.autodiff`, above the ops. The loop condition and body are
sub-graphs: they are built by calling the Python functions on placeholder tensors owned by the
loop operation, kept out of ``graph.operations``, and lowered once each into a separate step
list (:meth:`meshtorch.lowering.planner.Planner.lower_subprogram`) that the loop's single step runs
while the condition holds.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence

import torch

from meshtorch.core.errors import ShapeError
from meshtorch.core.graph import Operation, Tensor
from meshtorch.ops._kernels import filled
from meshtorch.ops.elementwise import identity
from meshtorch.ops.variables import Assign, Placeholder, Variable

__all__ = ["WhileLoopOperation", "while_loop", "CustomGradientOperation", "custom_gradient",
           "Depend", "depend", "PrintOperation", "Print"]


def _check_tensors(xs, what: str) -> list[Tensor]:
    xs = [xs] if isinstance(xs, Tensor) else list(xs)
    if not xs:
        raise ValueError(f"{what}: needs at least one input tensor.")
    for i, x in enumerate(xs):
        if not isinstance(x, Tensor):
            raise TypeError(f"{what}: input {i} is {type(x).__name__}, expected an mtf Tensor.")
    return xs


def _capture(graph, fn: Callable, what: str):
    """Call ``fn()``; return (its result, the operations it added, minus Variables/Placeholders).

    Variables and placeholders made by ``fn`` stay in ``graph.operations`` (hoisted before the
    caller's op, as Mesh TF does for loop bodies); the other new operations are removed from the
    graph and returned, in creation order.
    """
    ops = graph.operations
    before = len(ops)
    result = fn()
    added = ops[before:]
    del ops[before:]
    inner = []
    for op in added:
        if isinstance(op, Variable | Placeholder):
            ops.append(op)
        elif isinstance(op, Assign):
            raise ValueError(f"{what}: assignments (mtf.assign) inside it are not supported; assign the "
                             "returned values outside instead.")
        else:
            inner.append(op)
    return result, inner


def _external_inputs(ops: Sequence[Operation], own: Sequence[Tensor], extra: Sequence[Tensor] = ()) -> list[Tensor]:
    """Tensors ``ops`` (and ``extra``) read that neither ``ops`` nor ``own`` produce, in first-read order."""
    produced = set(own) | {t for op in ops for t in op.outputs}
    out: dict[Tensor, None] = {}
    for t in [t for op in ops for t in op.inputs] + list(extra):
        if t not in produced:
            out[t] = None
    return list(out)


class WhileLoopOperation(Operation):
    """``while cond_fn(*vars): vars = body_fn(*vars)``, with optional accumulators (Mesh TF ``WhileLoopOperation``).

    Inputs are the ``n`` initial loop values followed by the tensors the condition and body capture
    from the enclosing graph. Outputs are the final loop values, then (``has_accumulators``) one
    accumulator per extra body output: its sum over all iterations. An accumulator's deferred
    all-reduce (e.g. an einsum contracting a split dim) is not done inside the body: the partial
    sums are accumulated locally and the output is a lazy sum, all-reduced once after the loop
    when a consumer needs it (as Mesh TF does with its ``LazyAllreduceSum``).

    No gradient (Mesh TF has none either): asking for one raises ``NotImplementedError``.
    """

    def __init__(self, cond_fn: Callable, body_fn: Callable, inputs, has_accumulators: bool = False,
                 name: str | None = None):
        inputs = _check_tensors(inputs, "while_loop")
        super().__init__(inputs, name=name or "while_loop")
        graph = self.graph
        graph.operations.pop()  # re-appended after the sub-graphs are built
        n = len(inputs)
        self.num_loop_vars = n
        self.has_accumulators = has_accumulators

        def placeholders(kind):
            return [Tensor(self, t.shape, t.dtype, index=-1, name=f"{self.name}/{kind}:{i}")
                    for i, t in enumerate(inputs)]

        self.cond_inputs = placeholders("cond_input")
        cond_out, self.cond_ops = _capture(graph, lambda: cond_fn(*self.cond_inputs),
                                           f"while_loop {self.name!r} cond")
        if not isinstance(cond_out, Tensor) or cond_out.shape.ndims != 0:
            raise ShapeError(f"while_loop {self.name!r}: cond_fn must return a scalar mtf Tensor (e.g. "
                             f"mtf.less(i, 5)), got {cond_out!r}.")
        self.cond_output = cond_out
        self.body_inputs = placeholders("body_input")
        body_out, self.body_ops = _capture(graph, lambda: body_fn(*self.body_inputs),
                                           f"while_loop {self.name!r} body")
        body_out = [body_out] if isinstance(body_out, Tensor) else list(body_out)
        if len(body_out) < n or (len(body_out) > n and not has_accumulators):
            raise ValueError(f"while_loop {self.name!r}: body_fn returned {len(body_out)} tensors for {n} loop "
                             "variables" + ("" if has_accumulators else " (extra outputs need has_accumulators=True)")
                             + ".")
        for i, (x, y) in enumerate(zip(inputs, body_out, strict=False)):
            if not isinstance(y, Tensor):
                raise TypeError(f"while_loop {self.name!r}: body output {i} is {type(y).__name__}, not an mtf Tensor.")
            if x.shape != y.shape or x.dtype != y.dtype:
                raise ShapeError(f"while_loop {self.name!r}: body output {i} {y.shape} {y.dtype} differs from loop "
                                 f"variable {x.name!r} {x.shape} {x.dtype}; the body must keep shapes and dtypes.")
        self.body_outputs = body_out
        self.captured = _external_inputs(self.cond_ops + self.body_ops, self.cond_inputs + self.body_inputs,
                                         [cond_out] + body_out)
        for t in self.captured:
            if t.mesh is not self.mesh:
                raise ValueError(f"while_loop {self.name!r}: captured tensor {t.name!r} is on another mesh.")
        self.inputs = inputs + self.captured
        graph.operations.append(self)
        self.outputs = [Tensor(self, t.shape, t.dtype, index=i) for i, t in enumerate(body_out)]

    def gradient(self, grad_ys):
        raise NotImplementedError(
            f"while_loop {self.name!r} has no gradient (Mesh TF's has none either). Differentiate inside the "
            "body (e.g. accumulate per-microbatch gradients as accumulators) or wrap the loop in stop_gradient.")

    def lower(self, lw):
        n = self.num_loop_vars
        cond = lw.lower_subprogram(self.cond_ops, self.cond_inputs, [self.cond_output])
        lazy = [False] * n + [True] * (len(self.body_outputs) - n)
        body = lw.lower_subprogram(self.body_ops, self.body_inputs, self.body_outputs, lazy)
        init = [lw.get(t) for t in self.inputs[:n]]
        zeros = [lw.pnum_constant(t, functools.partial(filled, sizes=tuple(lw.slice_shape(t)), value=0, dtype=t.dtype))
                 for t in self.outputs[n:]]
        f = functools.partial(_k_while_loop, n=n, nc=len(cond.external_slots), nb=len(body.external_slots))
        slots = lw.call(f, *init, *cond.external_slots, *body.external_slots, *zeros, num_outputs=len(self.outputs),
                        subprograms=[("cond", cond), ("body", body)])
        slots = [slots] if len(self.outputs) == 1 else list(slots)
        for i, (t, s) in enumerate(zip(self.outputs, slots, strict=True)):
            lw.set(t, s, body.pending[i] if i >= n else frozenset())


def _k_while_loop(ctx, *vals, n, nc, nb):
    """Run the loop: ``vals`` = initial loop values, cond externals, body externals, zero accumulators."""
    impl, cond, body = ctx.impl, ctx.subprograms["cond"], ctx.subprograms["body"]
    state, ext_c, ext_b = list(vals[:n]), vals[n:n + nc], vals[n + nc:n + nc + nb]
    accs = list(vals[n + nc + nb:])
    cond_counters, body_counters = ctx.records["cond"].counters, ctx.records["body"].counters
    while True:
        ctx.counters.add(cond_counters)
        flag = cond(state, ext_c)[0]
        if not bool(impl.local_slices(flag)[0].item()):
            break
        ctx.counters.add(body_counters)
        outs = body(state, ext_b)
        state = outs[:n]
        accs = [impl.slicewise(torch.add, a, o) for a, o in zip(accs, outs[n:], strict=True)]
    return state + accs if len(state) + len(accs) > 1 else (state + accs)[0]


def while_loop(cond_fn: Callable, body_fn: Callable, inputs, num_loop_vars: int | None = None,
               has_accumulators: bool = False, name: str | None = None) -> list[Tensor]:
    """A while loop over mtf Tensors (Mesh TF ``mtf.while_loop``).

    Args:
        cond_fn: ``cond_fn(*loop_vars) -> scalar Tensor`` (bool, or nonzero = true). A scalar is
            replicated, so every processor takes the same branch.
        body_fn: ``body_fn(*loop_vars) -> list`` of ``n`` new loop values (same named shapes and
            dtypes as ``inputs``), then, with ``has_accumulators``, extra tensors summed over iterations.
        inputs: the ``n`` initial loop values.
        num_loop_vars: Mesh TF option that turns all but the first ``num_loop_vars`` loop values into
            variables (a multi-GPU speed hack). Here every loop value is carried by the loop step, so
            the option only trims the result: the first ``num_loop_vars`` loop values, then the
            accumulators.
        has_accumulators: allow extra body outputs, accumulated (summed) over iterations, starting at 0.

    Returns:
        list of Tensors: the final loop values, then the accumulators.

    Raises:
        ShapeError: cond_fn does not return a scalar; a body output's shape or dtype differs from its input.
        ValueError: wrong number of body outputs; an assignment inside cond_fn/body_fn.

    Variables and placeholders created inside the functions are hoisted out of the loop. Random
    ops inside the body are keyed by op name, so they draw the same values every iteration.
    ``lowering.plan_counters`` cannot know the trip count: it counts the loop body zero times
    unless given ``loop_iterations`` (``{name: n}`` or one int); ``lowering.counters`` counts every
    executed iteration.
    """
    outs = WhileLoopOperation(cond_fn, body_fn, inputs, has_accumulators, name).outputs
    n = len(_check_tensors(inputs, "while_loop"))
    if num_loop_vars is not None:
        if not 0 < num_loop_vars <= n:
            raise ValueError(f"while_loop: num_loop_vars must be in 1..{n}, got {num_loop_vars}.")
        return outs[:num_loop_vars] + outs[n:]
    return outs


class CustomGradientOperation(Operation):
    """Outputs = ``fn``'s outputs; gradient = ``grad_fn``'s (Mesh TF ``CustomGradientOperation``).

    Inputs: ``all_inputs`` (the explicit inputs, then every other tensor the forward operations
    read, e.g. variables) followed by ``fn``'s outputs. Lowering aliases the outputs (no steps).
    """

    def __init__(self, explicit_inputs, all_inputs, fn_outputs, grad_fn, forward_operations, name=None):
        super().__init__(list(all_inputs) + list(fn_outputs), name=name or "custom_gradient")
        self.explicit_inputs = list(explicit_inputs)
        self.all_inputs = list(all_inputs)
        self.fn_outputs = list(fn_outputs)
        self.grad_fn = grad_fn
        self.forward_operations = list(forward_operations)
        self.outputs = [Tensor(self, t.shape, t.dtype, index=i) for i, t in enumerate(fn_outputs)]

    def lower(self, lw):
        for src, out in zip(self.fn_outputs, self.outputs, strict=True):
            slot, pending = lw.get_lazy(src)
            lw.set(out, slot, pending, source=(src, _same) if pending else None)

    def gradient(self, grad_ys):
        graph = self.graph
        n_vars = len(graph.all_variables)
        params = inspect.signature(self.grad_fn).parameters
        if "all_inputs" in params or "forward_operations" in params:
            grads = list(self.grad_fn(explicit_inputs=self.explicit_inputs, all_inputs=self.all_inputs,
                                      forward_operations=self.forward_operations, outputs=self.fn_outputs,
                                      output_grads=list(grad_ys)))
            want = self.all_inputs
        else:
            grads = list(self.grad_fn(self.explicit_inputs, self.fn_outputs, list(grad_ys)))
            want = self.explicit_inputs
        if len(graph.all_variables) != n_vars:
            raise ValueError(f"custom_gradient {self.name!r}: grad_fn must not create variables.")
        if len(grads) != len(want):
            raise ValueError(f"custom_gradient {self.name!r}: grad_fn returned {len(grads)} gradients for "
                             f"{len(want)} inputs.")
        for x, g in zip(want, grads, strict=True):
            if g is None:
                continue
            if not isinstance(g, Tensor) or set(g.shape.dimension_names) != set(x.shape.dimension_names):
                raise ShapeError(f"custom_gradient {self.name!r}: the gradient for {x.name!r} {x.shape} must be an "
                                 f"mtf Tensor with the same dims, got {g!r}.")
            if g.dtype != x.dtype:
                raise TypeError(f"custom_gradient {self.name!r}: the gradient for {x.name!r} has dtype {g.dtype}, "
                                f"expected {x.dtype}.")
        grads += [None] * (len(self.all_inputs) - len(grads))
        return grads + [None] * len(self.fn_outputs)


def _same(t):
    return t


def custom_gradient(fn: Callable, grad_fn: Callable, explicit_inputs) -> Tensor | list[Tensor]:
    """``fn(*inputs)`` as ordinary operations, its gradient given by ``grad_fn`` (Mesh TF ``mtf.custom_gradient``).

    Args:
        fn: ``fn(*inputs) -> Tensor or list of Tensors``.
        grad_fn: either the short form ``grad_fn(inputs, outputs, output_grads) -> [gradient per input]``,
            where tensors ``fn`` captures (e.g. variables) get no gradient; or Mesh TF's form, called with
            keywords ``explicit_inputs, all_inputs, forward_operations, outputs, output_grads`` and
            returning one gradient (or None) per ``all_inputs`` (the explicit inputs, then every other
            tensor the forward operations read, variables included). ``output_grads`` holds None for
            outputs that receive no gradient. Gradients must have their input's dims and dtype.
        explicit_inputs: list of Tensors (Mesh TF's name).

    Returns:
        what ``fn`` returns (a Tensor or a list), as outputs of a :class:`CustomGradientOperation`.

    Raises:
        ValueError: grad_fn creates variables or returns the wrong number of gradients; fn assigns.
        ShapeError / TypeError: a gradient's dims or dtype differ from its input's.
    """
    inputs = _check_tensors(explicit_inputs, "custom_gradient")
    graph = inputs[0].graph

    def build():
        out = fn(*inputs)
        single = isinstance(out, Tensor)
        outs = [out] if single else list(out)
        for i, t in enumerate(outs):
            if not isinstance(t, Tensor):
                raise TypeError(f"custom_gradient: fn output {i} is {type(t).__name__}, not an mtf Tensor.")
        return single, outs

    (single, outs), forward = _capture(graph, build, "custom_gradient fn")
    produced = {t for op in forward for t in op.outputs}
    for i, t in enumerate(outs):  # an output fn did not compute gets its own op (as Mesh TF)
        if t not in produced:
            ops = graph.operations
            outs[i] = identity(t)
            forward.append(ops.pop())
    all_inputs = inputs + [t for t in _external_inputs(forward, ()) if t not in inputs]
    graph.operations.extend(forward)
    result = CustomGradientOperation(inputs, all_inputs, outs, grad_fn, forward).outputs
    return result[0] if single else result


class Depend(Operation):
    """``x``, computed after ``dependencies`` (Mesh TF ``Depend``): fetching it runs their steps too."""

    def __init__(self, x: Tensor, dependencies, name=None):
        if not isinstance(x, Tensor):
            raise TypeError(f"depend: x must be an mtf Tensor, got {type(x).__name__}.")
        deps = []
        for d in dependencies:
            if isinstance(d, Assign):
                raise ValueError(f"depend: {d.name!r} is an assignment; assignments take effect only when the assign "
                                 "op itself is fetched in lowering.run (all together, at the end of the run).")
            if isinstance(d, Tensor):
                deps.append(d)
            elif isinstance(d, Operation):
                deps.extend(d.outputs)
            else:
                raise TypeError(f"depend: dependencies must be mtf Tensors or Operations, got {d!r}.")
        super().__init__([x] + deps, name=name or "depend")
        self.outputs = [Tensor(self, x.shape, x.dtype)]

    def lower(self, lw):
        slots = [lw.get(t) for t in self.inputs]
        lw.set(self.outputs[0], lw.call(_k_first, *slots))

    def gradient(self, grad_ys):
        return [grad_ys[0]] + [None] * (len(self.inputs) - 1)


def _k_first(ctx, x, *rest):
    return x


def depend(x: Tensor, dependencies) -> Tensor:
    """Identity of ``x`` whose computation includes ``dependencies`` (Mesh TF ``mtf.depend``).

    Args:
        x: Tensor.
        dependencies: list of Tensors or Operations (not assignments: see Raises).

    Returns:
        Tensor equal to ``x`` (same shape and dtype); the gradient passes to ``x``.

    Raises:
        ValueError: a dependency is an Assign op (assignments commit only when fetched).
        TypeError: a dependency is not a Tensor or Operation.
    """
    return Depend(x, dependencies).outputs[0]


class PrintOperation(Operation):
    """``x`` unchanged; when its step runs, prints ``message`` and each processor's slices of ``data``."""

    def __init__(self, x: Tensor, data, message: str, summarize: int = 3, name=None):
        data = [data] if isinstance(data, Tensor) else list(data)
        super().__init__([x] + data, name=name or "Print")
        self.message = message
        self.summarize = summarize
        self.outputs = [Tensor(self, x.shape, x.dtype)]

    def lower(self, lw):
        slots = [lw.get(t) for t in self.inputs]
        f = functools.partial(_k_print, names=tuple(t.name for t in self.inputs[1:]), message=self.message,
                              k=self.summarize)
        lw.set(self.outputs[0], lw.call(f, *slots))

    def gradient(self, grad_ys):
        return [grad_ys[0]] + [None] * (len(self.inputs) - 1)


def _k_print(ctx, x, *data, names, message, k):
    impl = ctx.impl
    parts = [[_summary(s, k) for s in impl.local_slices(d)] for d in data]
    pnums = _local_pnums(impl, len(impl.local_slices(x)))
    for i, p in enumerate(pnums):
        text = " ".join(f"{n}={v[i]}" for n, v in zip(names, parts, strict=True))
        print(f"{message} [processor {p}] {text}", flush=True)
    return x


def _summary(t: torch.Tensor, k: int) -> str:
    flat = t.detach().reshape(-1)
    vals = ", ".join(f"{v:.6g}" if isinstance(v, float) else str(v) for v in flat[:k].tolist())
    return f"[{vals}{', ...' if flat.numel() > k else ''}] shape={list(t.shape)}"


def _local_pnums(impl, n_local: int) -> list[int]:
    if n_local == impl.size:
        return list(range(n_local))
    p = getattr(impl, "pnum", None)
    return [p] if p is not None and n_local == 1 else list(range(n_local))


def Print(x: Tensor, data, message: str, summarize: int = 3, name=None) -> Tensor:  # noqa: N802 - Mesh TF's name
    """Debug printing (Mesh TF ``mtf.Print``, after ``tf.Print``): returns ``x`` unchanged.

    Each time the step runs, prints one line per processor (of this process): ``message``, the
    processor number and, for each tensor in ``data``, the first ``summarize`` elements and shape
    of that processor's slice. The print happens only when ``x``'s value (returned) is used by a
    fetch. The gradient passes through to ``x``.
    """
    return PrintOperation(x, data, message, summarize, name).outputs[0]
