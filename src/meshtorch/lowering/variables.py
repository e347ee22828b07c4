"""The variable store: each variable's laid-out value between runs.

A program names its variables and the layout each is stored in (its storage layout); the store
holds their values for one set of mesh implementations. Checkpoints, interchange with PyTorch
state dicts and planning talk to the store (by variable name), never to the planner.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from meshtorch.core.dims import Dimension, Shape
from meshtorch.core.errors import FeedError
from meshtorch.core.layout import TensorLayout
from meshtorch.lowering.program import TensorSlot
from meshtorch.ops.initializers import fills_zeros, populate


def spec_shape(spec: TensorSlot) -> Shape:
    """The named :class:`~meshtorch.core.dims.Shape` of a program slot's tensor."""
    return Shape([Dimension(n, s) for n, s in spec.shape])


def check_full(name: str, spec: TensorSlot, value, what: str = "Placeholder") -> torch.Tensor:
    """``value`` as a torch tensor of ``spec``'s dtype, checked against its full shape.

    Raises:
        FeedError: naming ``name`` and both shapes, if the sizes differ.
    """
    if not isinstance(value, torch.Tensor):
        value = torch.as_tensor(value)
    want = tuple(s for _, s in spec.shape)
    if tuple(value.shape) != want:
        raise FeedError(f"{what} {name!r} expects shape {spec_shape(spec)} (sizes {list(want)}), "
                        f"but was fed a tensor of shape {list(value.shape)}.")
    if (value.is_floating_point() or value.is_complex()) and not (spec.dtype.is_floating_point
                                                                   or spec.dtype.is_complex):
        raise FeedError(f"{what} {name!r} has dtype {str(spec.dtype).replace('torch.', '')} but was fed "
                        f"{str(value.dtype).replace('torch.', '')} values, which would be truncated; feed integers "
                        "(e.g. tensor.long()).")
    return value.to(spec.dtype)


class VariableStore:
    """Laid-out values of a program's variables on ``{mesh name: MeshImpl}``.

    ``initialize=True`` draws every variable's initial value from the program's initializers
    (:attr:`Program.initializers`; the same values as the Lowering that planned it, on any mesh and
    layout, in one process or on torchrun ranks). A variable whose initializer did not survive JSON
    keeps no value until :meth:`set_value`; a run reading it raises an error naming it.

    Attributes:
        values: ``{variable name: laid-out value}`` (None: no value, e.g. a dry run).
        specs: ``{variable name: TensorSlot}``: shape, dtype, mesh and storage layout.
    """

    def __init__(self, program, impls: dict, initialize: bool = True):
        self.specs: dict[str, TensorSlot] = dict(program.variables)
        self.impls = impls
        self.trainable = set(program.trainable)
        self.initializers = dict(getattr(program, "initializers", {}))
        self.values: dict[str, object] = {name: None for name in self.specs}
        self.pending: dict = {}  # variables not drawn yet: {name: initializer kernel}
        self.untouched: set = set()  # drawn as untouched zero pages and not run yet (see populate)
        if initialize:
            self.initialize()

    def _spec(self, name: str) -> TensorSlot:
        try:
            return self.specs[name]
        except KeyError:
            raise KeyError(f"No variable named {name!r}; known: {sorted(self.specs)}") from None

    @property
    def names(self) -> list[str]:
        return list(self.specs)

    def impl(self, name: str):
        return self.impls[self._spec(name).mesh]

    def layout(self, name: str) -> TensorLayout:
        """The storage layout of variable ``name``."""
        return TensorLayout(self._spec(name).layout)

    def shape(self, name: str) -> Shape:
        return spec_shape(self._spec(name))

    def initialize(self, names=None, lazy: bool = False):
        """Draw initial values: each processor's slice from the variable's initializer kernel
        (:attr:`Program.initializers`), for ``names`` (default: every variable that has one; a subset when
        the others are set slice by slice, e.g. by :func:`meshtorch.checkpoint.hf.load`).

        ``lazy``: draw nothing now; a variable is drawn when first needed (a run reading it,
        :meth:`value`, :meth:`draw_pending`) unless :meth:`set_value` / :meth:`set_slices` (a checkpoint
        restore, a PyTorch state dict import) gave it a value first, so restored variables are never drawn.
        """
        names = self.specs if names is None else names
        self.pending = {n: self.initializers[n] for n in names if self.initializers.get(n) is not None}
        if not lazy:
            self.draw_pending()

    def draw_pending(self, names=None):
        """Draw the initial values of the pending variables ``names`` (default: all) not set yet: each
        processor draws only its slice (counter-based: the same values under every layout), in chunks
        straight into the slice's dtype; processors holding the same slice on one device share one tensor."""
        for name in list(self.pending) if names is None else [n for n in names if n in self.pending]:
            kernel = self.pending.pop(name)
            impl, layout, shape = self.impl(name), self.layout(name), self.shape(name)
            sizes = impl.slice_shape(shape, layout)
            drawn: dict = {}

            def draw(p, kernel=kernel, impl=impl, layout=layout, shape=shape, sizes=sizes, drawn=drawn):
                begin, device = tuple(impl.slice_begin(shape, p, layout)), impl.device(p)
                if (begin, device) not in drawn:
                    drawn[begin, device] = kernel(begin, sizes, device)
                return drawn[begin, device]

            self.values[name] = impl.share_replicas(impl.laid_out_constant(draw), layout)
            if fills_zeros(kernel):
                self.untouched.add(name)

    def populate(self, names) -> None:
        """Before a run reads variables ``names``: the zero-filled ones not run yet get their memory now, in one
        call per slice (:func:`meshtorch.ops.initializers.populate`: the faults of their first write without a
        second one per page when the run reads them first, as AdamW's update reads its moments)."""
        for name in [n for n in names if n in self.untouched]:
            self.untouched.discard(name)
            for t in self.impl(name).local_slices(self.values[name]):
                if isinstance(t, torch.Tensor):
                    populate(t)

    def _storages(self, names) -> set:
        """Storage addresses of the local slices of variables ``names``."""
        out = set()
        for name in names:
            v = self.values[name]
            if v is not None:
                out.update(t.untyped_storage().data_ptr() for t in self.impl(name).local_slices(v)
                           if isinstance(t, torch.Tensor))
        return out

    def check_has_values(self, names) -> None:
        """Raise FeedError naming the first of ``names`` that has no value (an initializer lost in JSON)."""
        for name in names:
            if self.values.get(name) is None:
                raise FeedError(f"Variable {name!r} {self.shape(name)} has no value: its initializer could not be "
                                f"written as plain data; set one with store.set_value({name!r}, tensor).")

    def value(self, name: str) -> torch.Tensor:
        """The full value of variable ``name`` (gathered from its slices); a tensor of its own, which the
        in-place updates of later runs (:meth:`commit`) do not change."""
        self.draw_pending([name])
        full = self.impl(name).export_full(self.values[name], self.layout(name))
        return full.clone() if full.untyped_storage().data_ptr() in self._storages([name]) else full

    def commit(self, new_values: list, keep: list) -> list:
        """A run's assignments ``[(variable name, laid-out new value)]``, written in place into the
        variables' storage (no per-step reallocation of the store: each slice keeps its ``data_ptr``).

        New values that alias the storage of a variable being written (``assign(x, y)`` with ``y`` also
        assigned) are copied first, so all assignments see the run's values (the session's run semantics);
        tensors in ``keep`` (the run's fetched results) that alias a written variable are cloned and
        returned in its place. A value whose slices differ in shape or dtype from the stored ones replaces
        them. Returns ``keep`` with those clones.
        """
        written = self._storages(n for n, _ in new_values)

        def aliased(t):
            return isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in written

        keep = [[t.clone() if aliased(t) else t for t in r] if isinstance(r, list) else
                (r.clone() if aliased(r) else r) for r in keep]
        copies = []
        for name, new in new_values:
            self.pending.pop(name, None)
            self.untouched.discard(name)
            old = self.values[name]
            if new is old:  # updated in place in its own storage (a fused optimizer's kernel): nothing to write
                continue
            impl = self.impl(name)
            new = impl.materialize(new)
            olds = None if old is None else impl.local_slices(old)
            news = impl.local_slices(new)
            if olds is None or len(olds) != len(news) or any(
                    not isinstance(o, torch.Tensor) or o.shape != n.shape or o.dtype != n.dtype
                    for o, n in zip(olds, news, strict=True)):
                self.values[name] = new
                continue
            for o, n in zip(olds, news, strict=True):
                if o is not n and o.data_ptr() != n.data_ptr():
                    copies.append((o, n.clone() if aliased(n) else n))
        done = set()
        for o, n in copies:
            if id(o) not in done:
                done.add(id(o))
                o.copy_(n)
        return keep

    def set_value(self, name: str, value):
        """Overwrite variable ``name`` with a full tensor of its shape (cast to its dtype).

        Raises:
            FeedError: naming the variable, if the shape differs.
        """
        value = check_full(name, self._spec(name), value, "Variable").clone()
        self.pending.pop(name, None)
        self.untouched.discard(name)
        self.values[name] = self.impl(name).import_full(value, self.layout(name))

    def set_slices(self, name: str, fn: Callable[[int], torch.Tensor], owned: bool = False):
        """Overwrite variable ``name`` slice by slice: processor ``pnum`` gets ``fn(pnum)`` (see
        :meth:`meshtorch.Lowering.set_variable_slices`). ``owned``: ``fn`` returns new tensors nobody else
        holds (e.g. read from a file), kept as they are when of the variable's dtype and the processor's device
        and contiguous; otherwise each slice is copied (later runs update the store's slices in place), and a
        process reading a large model holds every slice twice for a moment (and the C allocator may keep the
        freed copies: the resident set then stays above the bytes held).

        Raises:
            FeedError: naming the variable and processor, if a slice has the wrong shape.
        """
        spec = self._spec(name)
        impl = self.impl(name)
        layout = self.layout(name)
        want = impl.slice_shape(spec_shape(spec), layout)

        def make(p):
            t = fn(p)
            if list(t.shape) != want:
                raise FeedError(f"set_variable_slices: variable {name!r} {spec_shape(spec)} needs slices of sizes "
                                f"{want} on processor {p}, got {list(t.shape)}.")
            if owned and t.dtype == spec.dtype and t.device == impl.device(p) and t.is_contiguous():
                return t
            return t.to(device=impl.device(p), dtype=spec.dtype, copy=True)  # runs update it in place

        self.pending.pop(name, None)
        self.untouched.discard(name)
        self.values[name] = impl.share_replicas(impl.laid_out_constant(make), layout)
