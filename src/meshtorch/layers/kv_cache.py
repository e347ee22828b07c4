"""Key/value caches for incremental decoding (Mesh TF ``mtf.transformer``'s ``first_part`` / ``incremental``
modes; gpt-fast's static cache), on named dims.

A decoder graph holds two programs over the same weights: the **prefill** (Mesh TF's ``first_part``) runs
the model over a whole ``[batch, length]`` window, as training does, and writes every self-attention
layer's keys and values into preallocated caches; the **step** (Mesh TF's ``incremental``) runs one token
per sequence at a ``position`` (an int32 scalar fed at each run), writes that position of each cache and
attends over the cache with the later positions masked. A layer's caches are non-trainable variables
``{layer}/k_cache`` and ``{layer}/v_cache`` of shape ``[batch..., heads, memory_length, d_kv]`` (``kv_heads``
for grouped-query attention): laid out by the same rules as the activations (``batch:data`` splits their
batch, ``heads:model`` their heads: tensor-parallel decoding), and never in a checkpoint. The write is an
``assign`` of the cache with ``position`` replaced (:class:`CacheWriteOperation`, an ``index_copy_``; variables are
read as of the run's start, :mod:`meshtorch.lowering`): the assign is the write, and the plan lets the
``index_copy_`` go straight into the cache's storage only in a run that fetches that assign
(:mod:`meshtorch.lowering.donate`; a run without it leaves the caches as they were): one run of the step costs one
position of the model's matmuls plus attention over ``memory_length`` cached positions.
The step reads some weights from copies in the form its matrix-vector products read fastest (:meth:`Step.derive`:
a tied head as ``[d_model, vocab]``, q/k/v kernels stacked for one matmul), refreshed whenever the weights change.

The model's attention code calls a :class:`FullSequence` (training: causal attention, rotary over
``length``), :class:`Prefill` or :class:`Step` object for its rotary positions and its attention, so one
block definition serves training and both decoding programs.
"""

from __future__ import annotations

import functools

import torch

from meshtorch.core.dims import Dimension, Shape, convert_to_shape
from meshtorch.core.errors import ShapeError
from meshtorch.core.graph import Operation, Tensor
from meshtorch.layers.attention import attention, grouped_query_attention
from meshtorch.ops.binary import greater
from meshtorch.ops.elementwise import cast
from meshtorch.ops.indexing import gather
from meshtorch.ops.reshape import rename_dimension, reshape, transpose
from meshtorch.ops.rotary import rotary, rotary_cos_sin
from meshtorch.ops.sequence import mtf_range
from meshtorch.ops.shape import concat, split
from meshtorch.ops.variables import Variable, assign, get_variable, import_tensor

__all__ = ["FullSequence", "Prefill", "Step", "MEMORY", "ReplayVariables", "reorder_rows"]

#: the cache's sequence dim (its size is the decoder's context ``length``)
MEMORY = "memory_length"


class FullSequence:
    """Positions and attention over a whole ``length`` window (training, and the recompute path).

    Args:
        length: the query/key sequence dim's name. key: the feature dim's name.
    """

    def __init__(self, length: str = "length", key: str = "d_kv"):
        self.length, self.key = length, key

    def rotary(self, x: Tensor, theta: float, name: str) -> Tensor:
        """Rotary positions 0 .. length - 1 (:func:`meshtorch.ops.rotary.rotary`)."""
        return rotary(x, self.length, self.key, theta=theta, name=name)

    #: the pass keeps copies of weights in the layout its matmuls read fastest (:meth:`Step.derive`); here not:
    #: a whole window's matmuls are matrix-matrix products, and training must read the weights themselves
    derives = False

    def weight(self, w: Tensor, shape, name: str) -> Tensor:
        """The weight ``w`` for a matmul that reads it fastest with its dims in ``shape``'s order: here ``w``
        itself (:meth:`Step.weight` keeps a copy)."""
        return w

    def attend(self, q: Tensor, k: Tensor, v: Tensor, scale: float, name: str, heads: str = "heads",
               kv_heads: str | None = None) -> Tensor:
        """Causal self-attention of ``q`` ``[batch.., length, heads, key]`` over ``k``/``v`` (grouped-query
        when ``kv_heads`` names their heads dim)."""
        if kv_heads is None:
            return attention(q, k, v, self.length, self.key, length_dim=self.length, causal=True, scale=scale,
                             name=name)
        return grouped_query_attention(q, k, v, self.length, self.key, heads, kv_heads, causal=True, scale=scale,
                                       name=name)


class _Caches:
    """The caches of one decoder graph, in the order the layers ask for them (prefill first, step second)."""

    def __init__(self, memory_length: int):
        self.memory = Dimension(MEMORY, memory_length)
        self.pairs: list[tuple[Tensor, Tensor]] = []


def _cache_shape(k: Tensor, length: str | None, key: str, memory: Dimension) -> Shape:
    """``[k's dims but length and key..., memory_length, key]``."""
    rest = [d for d in k.shape if d.name not in (length, key)]
    return Shape(rest + [memory, k.shape.get_dim_by_name(key)])


class Prefill(FullSequence):
    """The prefill (``first_part``) pass: :class:`FullSequence` attention that also writes each layer's keys
    and values, all ``length`` positions, into new cache variables ``{name}/k_cache`` / ``{name}/v_cache``.

    ``assigns`` collects the cache writes: fetch them with the logits.
    """

    def __init__(self, memory_length: int, length: str = "length", key: str = "d_kv"):
        super().__init__(length, key)
        self.caches = _Caches(memory_length)
        self.assigns: list = []

    def write(self, k: Tensor, v: Tensor, name: str) -> None:
        """Write ``k`` and ``v`` (``[..., length or memory_length, key]``, all positions) into new cache variables
        ``{name}/k_cache`` / ``{name}/v_cache`` (the next pair of :attr:`caches`; their writes go to
        :attr:`assigns`).

        Raises:
            ShapeError: naming the keys, if their sequence dim is not of the cache's size."""
        mem = self.caches.memory
        length = self.length if self.length in k.shape.dimension_names else MEMORY
        if length not in k.shape.dimension_names or k.shape.get_dim_by_name(length).size != mem.size:
            raise ShapeError(f"Prefill: keys {k.name!r} {k.shape} must have {self.length!r} or {MEMORY!r} of the "
                             f"cache's size {mem.size}.")
        pair = []
        for t, what in ((k, "k"), (v, "v")):
            t = rename_dimension(t, length, MEMORY) if length != MEMORY else t
            var = get_variable(t.mesh, f"{name}/{what}_cache", _cache_shape(t, MEMORY, self.key, mem), dtype=t.dtype,
                               initializer=0.0, trainable=False)
            self.assigns.append(assign(var, t, name=f"{name}/{what}_write"))
            pair.append(var)
        self.caches.pairs.append(tuple(pair))

    def attend(self, q, k, v, scale, name, heads="heads", kv_heads=None):
        self.write(k, v, name)
        return super().attend(q, k, v, scale, name, heads, kv_heads)


class Step(FullSequence):
    """One incremental decoding step (``incremental``): queries, keys and values of one position per
    sequence (no ``length`` dim) at ``position`` (an int32 scalar Tensor, 0-based).

    :meth:`attend` writes ``k``/``v`` into the caches the :class:`Prefill` of the same graph made (the
    ``i``-th call uses the ``i``-th layer's caches) and attends over cached positions ``<= position``;
    :meth:`rotary` rotates by ``position``. ``assigns`` collects the cache writes (fetch them with the logits: they
    are the writes; the in-place ``index_copy_`` is only their early form).
    """

    def __init__(self, prefill: Prefill, position: Tensor, key: str = "d_kv"):
        super().__init__(prefill.length, key)
        self.caches, self.position = prefill.caches, position
        self.assigns: list = []
        self.refresh: list = []  # the derived weights' writes (:meth:`weight`)
        self.derived: dict[str, list] = {}  # derived weight variable name -> its sources' names
        self._next = 0
        self._rotations: dict = {}
        mem = self.caches.memory
        later = greater(mtf_range(position.mesh, mem, dtype=position.dtype), position)
        self._bias = cast(later, torch.float32) * -1e9  # [memory_length]: the positions not yet written
        self._index = cast(position, torch.int64)  # index_copy_'s index dtype: cast once per step, not per write

    def rotary(self, x: Tensor, theta: float, name: str) -> Tensor:
        """``x`` ``[..., key]`` rotated by ``position`` as :func:`meshtorch.ops.rotary.rotary` rotates position
        ``position`` of a sequence (``x cos + rotate_half(x) sin``, same float32 tables)."""
        d = x.shape.get_dim_by_name(self.key)
        key = (theta, d, x.dtype)
        if key not in self._rotations:  # one cos / sin row per graph, shared by every layer's q and k
            pos = Dimension("rotary_positions", self.caches.memory.size)
            cos, sin = rotary_cos_sin(pos.size, d.size, theta, x.dtype)
            self._rotations[key] = tuple(
                gather(import_tensor(x.mesh, t, [pos, d], name=f"rotary_{n}_table"), self.position, pos)
                for t, n in ((cos, "cos"), (sin, "sin")))
        cos_p, sin_p = self._rotations[key]
        lo, hi = split(x, self.key, 2, name=f"{name}/halves")
        half = concat([hi * -1.0, lo], self.key, name=f"{name}/rotate_half")
        return x * cos_p + half * sin_p

    derives = True

    def weight(self, w: Tensor, shape, name: str) -> Tensor:
        """``w`` (a variable's value) with its dims in ``shape``'s order, kept contiguous in a variable ``name``
        (:meth:`derive` of :func:`~meshtorch.ops.reshape.transpose` with ``copy``): one token's matmul streams
        the whole weight, and BLAS reads a ``[d_model, vocab]`` operand faster than the strided transposed view
        of a tied ``[vocab, d_model]`` embedding (about 1.5x on one CPU thread)."""
        return self.derive(transpose(w, convert_to_shape(shape), name=f"{name}/transpose", copy=True), name)

    def derive(self, value: Tensor, name: str) -> Tensor:
        """``value`` (a function of weights, e.g. q/k/v kernels stacked for one matmul) kept in a new
        non-trainable variable ``name`` of its shape and dtype, which the step reads instead of computing it.
        :attr:`refresh` holds the write of ``value`` into it (run after every change of the weights:
        :class:`meshtorch.runtime.generate.CachedDecoder`); :attr:`derived` maps ``name`` to the names of the
        variables ``value`` is computed from."""
        var = get_variable(value.mesh, name, value.shape, dtype=value.dtype, initializer=0.0, trainable=False)
        self.refresh.append(assign(var, value, name=f"{name}/refresh"))
        self.derived[var.operation.name] = _variables_of(value)
        return var

    def attend(self, q, k, v, scale, name, heads="heads", kv_heads=None, bias: Tensor | None = None):
        """Write ``k``/``v`` at ``position`` into the next layer's caches; attention of ``q`` over them, positions
        after ``position`` masked; ``bias`` (e.g. T5's relative position bias ``[heads, memory_length]``) added to
        the logits."""
        if self._next >= len(self.caches.pairs):
            raise ShapeError(f"Step: attention {name!r} is call {self._next + 1}, but the prefill made only "
                             f"{len(self.caches.pairs)} cache pairs; build the step with the prefill's layers.")
        k_var, v_var = self.caches.pairs[self._next]
        self._next += 1
        new = []
        for t, var, what in ((k, k_var, "k"), (v, v_var, "v")):
            full = CacheWriteOperation(var, t, self._index, name=f"{name}/{what}_write_value").outputs[0]
            self.assigns.append(assign(var, full, name=f"{name}/{what}_write"))
            new.append(full)
        mask = cast(self._bias, q.dtype) if q.dtype != torch.float32 else self._bias
        bias = mask if bias is None else mask + bias
        # the queries get a length dim, so attention runs as the fused op (F.scaled_dot_product_attention, one
        # kernel per slice) with the bias as its mask: one query (multi-head), or a group's queries, which share
        # their keys and values (grouped-query)
        if kv_heads is None:
            i = q.shape.dims.index(q.shape.get_dim_by_name(self.key))
            length = Dimension("step_length", 1)
            queries = Shape(q.shape.dims[:i] + [length] + q.shape.dims[i:])
        else:
            h, g = q.shape.get_dim_by_name(heads), k.shape.get_dim_by_name(kv_heads)
            i = q.shape.dims.index(h)
            length = Dimension("kv_group", h.size // g.size)
            queries = Shape(q.shape.dims[:i] + [g, length] + q.shape.dims[i + 1:])
        o = attention(reshape(q, queries, name=f"{name}/queries"), new[0], new[1], MEMORY, self.key,
                      length_dim=length.name, scale=scale, bias=bias, name=name)
        return reshape(o, Shape([d for d in q.shape]), name=f"{name}/heads")


def _k_cache_write(cache: torch.Tensor, new: torch.Tensor, position: torch.Tensor, *, dim: int, perm,
                   donate: bool = False) -> torch.Tensor:
    """``cache`` with index ``position`` of ``dim`` set to ``new`` (``cache``'s dims but ``dim``, in the order
    ``perm`` of its own): written into ``cache`` when the plan donates it (no later reader of the old value),
    else into a copy."""
    out = cache if donate and not torch.compiler.is_compiling() else cache.clone()
    new = new if perm is None else new.permute(perm)
    return out.index_copy_(dim, position.reshape(1), new.unsqueeze(dim).to(out.dtype))


_k_cache_write.donates = (0,)  # the cache may be written in place (meshtorch.lowering.donate)
_k_cache_write.fresh_outputs = True  # without donate=True the output is a new tensor


class CacheWriteOperation(Operation):
    """A cache ``[..., memory_length, ...]`` with position ``position`` (int64 scalar) of ``memory_length`` set to
    ``new`` (the cache's other dims): gpt-fast's ``index_copy_`` into a static cache, in place in the cache
    variable's storage when the plan allows (:mod:`meshtorch.lowering.donate`: the run assigns the cache, by the
    step's assign of this op's output, and this op is the cache's only reader; without the assign it writes a copy
    and the cache is unchanged), so a step copies one position, not the whole cache (a select of the whole cache,
    :func:`meshtorch.ops.shape.where`, then its copy into the variable, cost ~0.5 ms per layer at the GPT-2-small
    shape). ``memory_length`` is kept whole (a layout splitting it gathers it first).

    Raises:
        ShapeError: naming the op, if ``new``'s dims are not the cache's dims but ``memory_length``.
    """

    unsplittable_dims = (MEMORY,)

    def __init__(self, cache: Tensor, new: Tensor, position: Tensor, name=None):
        super().__init__([cache, new, position], name=name or "cache_write")
        rest = [d for d in cache.shape if d.name != MEMORY]
        if sorted(d.name for d in new.shape) != sorted(d.name for d in rest) or any(
                new.shape.get_dim_by_name(d.name).size != d.size for d in rest):
            raise ShapeError(f"cache write {self.name!r}: new value {new.shape} must have the cache's dims "
                             f"{Shape(rest)} (the cache {cache.shape} without {MEMORY!r}).")
        self.outputs = [Tensor(self, cache.shape, cache.dtype)]

    def lower(self, lw):
        cache, new, position = self.inputs
        rest = [d.name for d in cache.shape if d.name != MEMORY]
        perm = tuple(new.shape.dimension_names.index(n) for n in rest)
        f = functools.partial(_k_cache_write, dim=cache.shape.dimension_names.index(MEMORY),
                              perm=None if perm == tuple(range(len(perm))) else perm)
        lw.set(self.outputs[0], lw.slicewise(f, lw.get(cache), lw.get(new), lw.get(position)))


def _variables_of(t: Tensor) -> list[str]:
    """The names of the variables ``t`` is computed from (sorted)."""
    seen, todo, out = set(), [t.operation], set()
    while todo:
        op = todo.pop()
        if id(op) in seen:
            continue
        seen.add(id(op))
        if isinstance(op, Variable):
            out.add(op.name)
        todo.extend(x.operation for x in op.inputs)
    return sorted(out)


def reorder_rows(prefill: Prefill, src: Tensor, batch: str = "batch", more=()) -> list:
    """Cache writes that make row ``b`` of every cache (``prefill``'s, and the variables ``more``) the old row
    ``src[b]`` (beam search: each beam takes its parent's keys and values). ``src``: int64 ``[beam_src]`` with
    ``beam_src`` of the ``batch`` dim's size."""
    out = []
    for pair in list(prefill.caches.pairs) + [(var,) for var in more]:
        for var in pair:
            rows = gather(var, src, batch, name=f"{var.operation.name}/reorder_rows")
            out.append(assign(var, rename_dimension(rows, src.shape[0].name, batch),
                              name=f"{var.operation.name}/reorder"))
    return out


class ReplayVariables:
    """A ``variable_scope`` custom getter that hands out, in order, the variables a first pass got.

    Layers name their variables after graph-unique scope names (``layer_0/attention``, then
    ``layer_0/attention_1`` when the same code runs again in the same graph), so a second pass of the
    same model code would make new variables. :meth:`record` (first pass) notes each ``get_variable`` call;
    :meth:`replay` (second pass) returns the variable of the same call number, checking shape and leaf name.
    """

    def __init__(self):
        self.got: list[Tensor] = []
        self._i = 0

    def record(self, getter, mesh, full_name, shape, **kw):
        t = getter(mesh, full_name, shape, **kw)
        if kw.get("trainable", True):  # the model's weights; not the caches the prefill makes
            self.got.append((full_name, t))
        return t

    def replay(self, getter, mesh, full_name, shape, **kw):
        if not kw.get("trainable", True):  # a variable of the second pass only (Step.weight's copies)
            return getter(mesh, full_name, shape, **kw)
        if self._i >= len(self.got):
            raise ShapeError(f"ReplayVariables: variable {full_name!r} is call {self._i + 1}; the first pass made "
                             f"{len(self.got)}.")
        name, t = self.got[self._i]
        self._i += 1
        if name.rsplit("/", 1)[-1] != full_name.rsplit("/", 1)[-1] or t.shape != convert_to_shape(shape):
            raise ShapeError(f"ReplayVariables: call {self._i} asks for {full_name!r} {shape}; the first pass had "
                             f"{name!r} {t.shape}.")
        return t

