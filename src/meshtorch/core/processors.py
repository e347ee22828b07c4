"""Processor numbering and layout arithmetic as plain functions (Mesh TF's module-level helpers).

``pnum_to_processor_coordinates``, ``processor_coordinates_to_pnum``, ``pnum_to_group``,
``processor_groups``, ``tensor_dim_to_mesh_dim_size``, ``tensor_dim_to_size_per_split``,
``list_product``, ``transpose_list_of_lists``, ``is_subsequence``, ``verify_no_new_dims``,
``combined_dimension``, ``anonymous_shape`` and ``pretty_print_counters`` follow
mesh_tensorflow/ops.py. Processors are numbered row-major over the mesh shape, as there.
No PyTorch here.
"""

from __future__ import annotations

import builtins
import collections
import functools
import operator

from meshtorch.core.dims import Dimension, Shape, convert_to_dimension, convert_to_shape
from meshtorch.core.layout import convert_to_layout_rules

__all__ = ["pnum_to_processor_coordinates", "processor_coordinates_to_pnum", "pnum_to_group", "processor_groups",
           "tensor_dim_to_mesh_dim_size", "tensor_dim_to_size_per_split", "list_product",
           "transpose_list_of_lists", "is_subsequence", "verify_no_new_dims", "combined_dimension",
           "anonymous_shape", "pretty_print_counters"]


def _int_list(mesh_shape) -> list[int]:
    if isinstance(mesh_shape, Shape | str):
        return convert_to_shape(mesh_shape).to_integer_list()
    if isinstance(mesh_shape, list | tuple) and all(isinstance(s, int) for s in mesh_shape):
        return list(mesh_shape)
    raise ValueError(f"mesh_shape must be a Shape, a shape string or a list of integers, got {mesh_shape!r}.")


def pnum_to_processor_coordinates(mesh_shape, pnum: int) -> list[int]:
    """Coordinates of processor ``pnum`` on a mesh of ``mesh_shape`` (row-major; Mesh TF's function).

    ``mesh_shape``: a Shape, shape string or list of ints. Returns one int per mesh axis.
    """
    ret = []
    for size in reversed(_int_list(mesh_shape)):
        ret.append(pnum % size)
        pnum //= size
    return ret[::-1]


def processor_coordinates_to_pnum(mesh_shape, coord) -> int:
    """Inverse of :func:`pnum_to_processor_coordinates`."""
    ret, mult = 0, 1
    for c, d in zip(reversed(list(coord)), reversed(_int_list(mesh_shape)), strict=True):
        ret += mult * c
        mult *= d
    return ret


def pnum_to_group(mesh_shape, group_dims, pnum: int) -> int:
    """Number of the group of processors that differ from ``pnum`` only on mesh axes ``group_dims``
    (a list of axis indices): the processor's number on the mesh without those axes."""
    sizes = _int_list(mesh_shape)
    coord = pnum_to_processor_coordinates(sizes, pnum)
    keep = [i for i in builtins.range(len(sizes)) if i not in group_dims]
    return processor_coordinates_to_pnum([sizes[i] for i in keep], [coord[i] for i in keep])


def processor_groups(mesh_shape, group_dims) -> list[list[int]]:
    """Groups of processor numbers that differ only on mesh axes ``group_dims`` (Mesh TF's order)."""
    sizes = _int_list(mesh_shape)
    ret: list[list[int]] = []
    for pnum in builtins.range(list_product(sizes)):
        g = pnum_to_group(sizes, group_dims, pnum)
        while len(ret) <= g:
            ret.append([])
        ret[g].append(pnum)
    return ret


def tensor_dim_to_mesh_dim_size(layout, mesh_shape, tensor_dim) -> int:
    """How many ways ``tensor_dim`` is split under ``layout`` on ``mesh_shape`` (1 if not split)."""
    rules = convert_to_layout_rules(layout)
    mesh_shape = convert_to_shape(mesh_shape)
    axis = rules.tensor_dimension_to_mesh_axis(convert_to_dimension(tensor_dim).name, mesh_shape)
    return 1 if axis is None else mesh_shape.dims[axis].size


def tensor_dim_to_size_per_split(layout, mesh_shape, tensor_dim) -> int:
    """Size of each processor's part of ``tensor_dim``.

    Raises:
        ValueError: if the mesh axis size does not divide the dimension.
    """
    tensor_dim = convert_to_dimension(tensor_dim)
    n = tensor_dim_to_mesh_dim_size(layout, mesh_shape, tensor_dim)
    if tensor_dim.size % n:
        raise ValueError(f"Mesh dimension ({n}) must divide tensor dimension ({tensor_dim}).")
    return tensor_dim.size // n


def list_product(l) -> int:  # noqa: E741 - Mesh TF's parameter name
    """Product of a list of numbers (1 for an empty list)."""
    return functools.reduce(operator.mul, l, 1)


def transpose_list_of_lists(lol) -> list[list]:
    """Transpose a list of equally long lists. Raises ValueError on an empty list."""
    if not lol:
        raise ValueError("cannot transpose the empty list")
    return [list(x) for x in zip(*lol, strict=True)]


def is_subsequence(short_seq, long_seq) -> bool:
    """Whether ``short_seq`` is a (not necessarily contiguous) subsequence of ``long_seq``."""
    pos = 0
    for x in long_seq:
        if pos == len(short_seq):
            break
        if short_seq[pos] == x:
            pos += 1
    return pos == len(short_seq)


def verify_no_new_dims(input_shapes, output_shape) -> None:
    """Raise ValueError if ``output_shape`` has a dimension none of ``input_shapes`` has."""
    dims = {d for s in input_shapes for d in convert_to_shape(s).dims}
    new = [d for d in convert_to_shape(output_shape).dims if d not in dims]
    if new:
        raise ValueError(f"No new dimensions allowed in output: {new} are in output_shape {output_shape} "
                         f"but in none of the inputs {[str(s) for s in input_shapes]}.")


def combined_dimension(dims, name=None) -> Dimension:
    """One Dimension of the product of ``dims``' sizes, named ``name`` (default: the first dim's name)."""
    if not dims:
        raise ValueError("dims must be a list of one or more Dimensions")
    dims = [convert_to_dimension(d) for d in dims]
    return Dimension(name or dims[0].name, list_product([d.size for d in dims]))


def anonymous_shape(shape) -> Shape:
    """``shape`` with dims renamed ``_anonymous_0``, ``_anonymous_1``, ... (never named by layout rules,
    so never split)."""
    return Shape([Dimension(f"_anonymous_{i}", d.size) for i, d in enumerate(convert_to_shape(shape))])


def pretty_print_counters(counters) -> str:
    """Counters ``[(name, number)]`` totalled per slash-separated prefix, one ``"  name: 1.23"`` line each,
    indented by depth, sorted by name (Mesh TF's format ``%.3g``)."""
    totals: dict[str, float] = collections.defaultdict(int)
    for name, val in counters:
        for p in [name[:i] for i, ch in enumerate(name) if ch == "/"] + [name]:
            totals[p] += val
    return "\n".join(" " * n.count("/") + f"{n}: {v:.3g}" for n, v in sorted(totals.items()))
