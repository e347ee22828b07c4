"""Graph, Mesh, Tensor and Operation: the named-dimension program, before any layout.

Nothing here runs PyTorch computation; building a graph only records operations and infers
shapes. Mirrors Mesh TensorFlow's ``mtf.Graph``/``mtf.Mesh``/``mtf.Tensor``/``mtf.Operation``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from meshtorch.core.dims import convert_to_shape


class Graph:
    """A list of operations on named-dimension tensors, built in program order.

    Args:
        seed: seed for initial values and random ops (same values under every layout).

    Attributes:
        operations: every Operation, in creation order (a valid topological order).
        all_variables / trainable_variables: the Variable operations.
    """

    def __init__(self, seed: int = 0):
        #: seed of the counter-based generator (variable initializers, random ops)
        self.seed = int(seed)
        self.operations: list[Operation] = []
        self.all_variables: list = []
        self.trainable_variables: list = []
        #: full variable name -> Variable operation (Mesh TF ``graph.name_to_variable``)
        self.name_to_variable: dict = {}
        self._names: dict[str, int] = {}
        self._storage_depth = 0
        #: the :class:`~meshtorch.core.pipeline.PipelineSchedule` of a pipelined model (set by its builder), or None
        self.pipeline_schedule = None

    @contextlib.contextmanager
    def storage_scope(self):
        """Operations built inside see their tensors in the *storage* layout (the mesh's storage
        rules over its compute rules), as variables do: optimizer updates use it, so that with
        storage rules (FSDP / ZeRO-3) the update math runs on shards and a gradient that is a
        partial sum is reduce-scattered, never all-reduced. Without storage rules it changes nothing.
        """
        self._storage_depth += 1
        try:
            yield
        finally:
            self._storage_depth -= 1

    def unique_name(self, name: str) -> str:
        """``name`` if unused in this graph, else ``name_1``, ``name_2``, ..."""
        if name not in self._names:
            self._names[name] = 0
            return name
        while True:
            self._names[name] += 1
            cand = f"{name}_{self._names[name]}"
            if cand not in self._names:
                self._names[cand] = 0
                return cand

    def name_in_use(self, name: str) -> bool:
        return name in self._names

    def __repr__(self):
        return f"Graph({len(self.operations)} operations)"


class Mesh:
    """A named mesh in a graph; the mesh *shape* and layout come later, with the MeshImpl.

    Args:
        graph: the Graph.
        name: the mesh's name, used as key in ``Lowering(graph, {mesh: mesh_impl})``.
        variable_placer: Mesh TF's TF-device placer for variables; accepted and unused (a mesh
            implementation places every slice).
    """

    def __init__(self, graph: Graph, name: str = "mesh", variable_placer=None):
        self.graph = graph
        self.name = name
        self.variable_placer = variable_placer  # Mesh TF: a TF device placer; kept, unused here

    def __repr__(self):
        return f"Mesh({self.name!r})"


class Tensor:
    """The output of an Operation: a named shape and a dtype; values exist only after lowering.

    Python operators ``+ - * / -x`` build ops that broadcast by dimension name.
    """

    def __init__(self, operation: Operation, shape, dtype: torch.dtype, name: str | None = None, index: int = 0):
        self.operation = operation
        self.shape = convert_to_shape(shape)
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"Tensor dtype must be a torch.dtype, got {dtype!r}.")
        self.dtype = dtype
        self.index = index
        self.name = name or (operation.name if index == 0 else f"{operation.name}:{index}")

    @property
    def mesh(self) -> Mesh:
        return self.operation.mesh

    @property
    def graph(self) -> Graph:
        return self.operation.mesh.graph

    @property
    def size(self) -> int:
        return self.shape.size

    def __repr__(self):
        return f"Tensor({self.name!r}, {self.shape}, {str(self.dtype).replace('torch.', '')})"

    # Operators (+, -, *, /, ...) are bound by meshtorch.ops.binary: ops sit above core.


class Operation:
    """A node of the graph. Subclasses set ``outputs`` and implement ``lower`` and ``gradient``.

    ``lower(lowering)`` emits per-processor steps through the Lowering / MeshImpl interface;
    ``gradient(grad_ys)`` returns, for each input, a graph Tensor (or None).
    """

    #: dimension names this op needs whole on every processor (layouts may not split them)
    unsplittable_dims: tuple[str, ...] = ()
    #: False for ops no gradient flows through (sources, assignments, comparisons...)
    differentiable: bool = True
    #: sees tensors in their storage layout (variables, assignments, ops built in Graph.storage_scope)
    storage_side: bool = False
    #: elementwise: when every consumer of its output is storage-side, it may be too (``mtf.assign``
    #: propagates the storage layout back through such ops, as GSPMD propagates shardings)
    storage_propagates: bool = False
    #: sharding strategy for partial sums, declared as data and applied by the planner's
    #: ``inputs(op)``: None (every input fully reduced first), ``"linear"`` (linear in all inputs jointly:
    #: inputs that are all partial sums over the same mesh axes stay so, and so does the output, e.g.
    #: add, concat, add_n) or ``"first"`` (linear in input 0: it may stay a partial sum, the others are
    #: reduced, e.g. reduce_sum, transpose, shift, gather of weights). DTensor's ``Partial`` propagation.
    partial_sums: str | None = None
    #: built by ``mtf.gradients`` (the backward pass): with reshard-after-forward storage, a weight it
    #: reads is all-gathered again instead of kept from the forward pass
    backward: bool = False

    def __init__(self, inputs, mesh: Mesh | None = None, name: str | None = None):
        self.inputs: list[Tensor] = list(inputs)
        for i, t in enumerate(self.inputs):
            if not isinstance(t, Tensor):
                raise TypeError(f"{type(self).__name__}: input {i} is {type(t).__name__}, expected an mtf Tensor.")
        if mesh is None:
            if not self.inputs:
                raise ValueError(f"{type(self).__name__} needs a mesh when it has no inputs.")
            mesh = self.inputs[0].mesh
        for t in self.inputs:
            if t.mesh is not mesh:
                raise ValueError(
                    f"{type(self).__name__}: input {t.name!r} is on mesh {t.mesh.name!r}, not {mesh.name!r}; "
                    "move tensors between meshes explicitly."
                )
        self.mesh = mesh
        self.graph = mesh.graph
        self.name = self.graph.unique_name(name or type(self).__name__.replace("Operation", "").lower() or "op")
        self.outputs: list[Tensor] = []
        if self.graph._storage_depth:
            self.storage_side = True
        self.graph.operations.append(self)

    @property
    def has_gradient(self) -> bool:
        return self.differentiable

    def gradient(self, grad_ys):
        """Gradients for each input given gradients of each output (None = zero).

        Subclasses override this, or register a rule with :func:`register_gradient`.
        """
        rule = gradient_rule(type(self))
        if rule is not None:
            return rule(self, grad_ys)
        if not self.differentiable:
            return [None] * len(self.inputs)
        raise NotImplementedError(f"{type(self).__name__} {self.name!r} has no gradient.")

    def lower(self, lowering):
        raise NotImplementedError(f"{type(self).__name__} {self.name!r} has no lowering.")

    def __repr__(self):
        ins = ", ".join(t.name for t in self.inputs)
        return f"{type(self).__name__}({self.name!r}: {ins})"


#: gradient rules registered per Operation class (register_gradient); filled by meshtorch.ops.gradients
_GRADIENT_RULES: dict[type, Callable] = {}


def register_gradient(op_type: type) -> Callable:
    """Decorator: ``@register_gradient(SomeOperation) def rule(op, grad_ys) -> [Tensor | None per input]``.

    Most operations define ``gradient()`` next to their lowering. A rule that needs an op family which
    itself builds on the operation's family (reduce_sum's gradient is a broadcast, broadcast's is a
    reduce_sum) is registered from a module above both, :mod:`meshtorch.ops.gradients`, so imports
    between op families only point one way (TensorFlow's ``tf.RegisterGradient``). The rule of the
    nearest class in the op's MRO applies.

    Raises:
        TypeError: ``op_type`` is not an Operation subclass, or it (or a base below Operation)
            defines its own ``gradient()``, which would hide the rule.
        ValueError: ``op_type`` has a rule already.
    """
    if not (isinstance(op_type, type) and issubclass(op_type, Operation)) or op_type is Operation:
        raise TypeError(f"register_gradient: expected an Operation subclass, got {op_type!r}.")
    for cls in op_type.__mro__[:op_type.__mro__.index(Operation)]:
        if "gradient" in vars(cls):
            raise TypeError(f"register_gradient: {cls.__name__} defines gradient() itself, which would hide a "
                            f"rule registered for {op_type.__name__}; register for a class without one.")
    if op_type in _GRADIENT_RULES:
        raise ValueError(f"register_gradient: {op_type.__name__} already has a gradient rule "
                         f"({_GRADIENT_RULES[op_type].__module__}.{_GRADIENT_RULES[op_type].__qualname__}).")

    def register(rule: Callable) -> Callable:
        _GRADIENT_RULES[op_type] = rule
        return rule
    return register


def gradient_rule(op_type: type) -> Callable | None:
    """The rule :func:`register_gradient` registered for ``op_type`` or its nearest base, or None."""
    for cls in op_type.__mro__:
        rule = _GRADIENT_RULES.get(cls)
        if rule is not None:
            return rule
    return None
