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

    def initialize(self):
        """Draw initial values: each processor's slice from the variable's initializer kernel (variables
        without one are left as they are)."""
        for name, spec in self.specs.items():
            kernel = self.initializers.get(name)
            if kernel is None:
                continue
            impl, layout = self.impl(name), self.layout(name)
            shape = spec_shape(spec)
            sizes = impl.slice_shape(shape, layout)
            value = impl.laid_out_constant(
                lambda p, k=kernel: k(impl.slice_begin(shape, p, layout), sizes, impl.device(p)).to(spec.dtype))
            self.values[name] = impl.share_replicas(value, layout)

    def check_has_values(self, names) -> None:
        """Raise FeedError naming the first of ``names`` that has no value (an initializer lost in JSON)."""
        for name in names:
            if self.values.get(name) is None:
                raise FeedError(f"Variable {name!r} {self.shape(name)} has no value: its initializer could not be "
                                f"written as plain data; set one with store.set_value({name!r}, tensor).")

    def value(self, name: str) -> torch.Tensor:
        """The full value of variable ``name`` (gathered from its slices)."""
        return self.impl(name).export_full(self.values[name], self.layout(name))

    def set_value(self, name: str, value):
        """Overwrite variable ``name`` with a full tensor of its shape (cast to its dtype).

        Raises:
            FeedError: naming the variable, if the shape differs.
        """
        value = check_full(name, self._spec(name), value, "Variable").clone()
        self.values[name] = self.impl(name).import_full(value, self.layout(name))

    def set_slices(self, name: str, fn: Callable[[int], torch.Tensor]):
        """Overwrite variable ``name`` slice by slice: processor ``pnum`` gets ``fn(pnum)`` (see
        :meth:`meshtorch.Lowering.set_variable_slices`).

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
            return t.to(device=impl.device(p), dtype=spec.dtype)

        self.values[name] = impl.share_replicas(impl.laid_out_constant(make), layout)
