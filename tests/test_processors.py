"""Processor numbering and layout helpers (core/processors.py) vs NumPy and brute force."""

import itertools

import numpy as np
import pytest

import meshtorch as mtf


@pytest.mark.parametrize("sizes", [[4], [2, 3], [2, 3, 2]])
def test_coordinates_are_numpy_row_major(sizes):
    for p in range(int(np.prod(sizes))):
        coord = mtf.pnum_to_processor_coordinates(sizes, p)
        assert coord == [int(c) for c in np.unravel_index(p, sizes)]
        assert mtf.processor_coordinates_to_pnum(sizes, coord) == p
    shape = mtf.convert_to_shape(",".join(f"a{i}:{s}" for i, s in enumerate(sizes)))
    assert mtf.pnum_to_processor_coordinates(shape, int(np.prod(sizes)) - 1) == [s - 1 for s in sizes]


@pytest.mark.parametrize("sizes,group_dims", [([2, 3], [0]), ([2, 3], [1]), ([2, 3, 2], [0, 2]), ([4], [])])
def test_processor_groups_differ_only_on_group_dims(sizes, group_dims):
    groups = mtf.processor_groups(sizes, group_dims)
    coords = {p: np.unravel_index(p, sizes) for p in range(int(np.prod(sizes)))}
    assert sorted(itertools.chain(*groups)) == list(range(int(np.prod(sizes))))
    for grp in groups:
        assert grp == sorted(grp)
        for a, b in itertools.combinations(grp, 2):
            assert all(coords[a][i] == coords[b][i] for i in range(len(sizes)) if i not in group_dims)
    assert len(groups) == int(np.prod([s for i, s in enumerate(sizes) if i not in group_dims]))
    for p in coords:
        assert p in groups[mtf.pnum_to_group(sizes, group_dims, p)]


def test_tensor_dim_helpers():
    assert mtf.tensor_dim_to_mesh_dim_size("batch:rows", "rows:2;cols:3", mtf.Dimension("batch", 8)) == 2
    assert mtf.tensor_dim_to_mesh_dim_size("batch:rows", "rows:2;cols:3", mtf.Dimension("d", 8)) == 1
    assert mtf.tensor_dim_to_size_per_split([("d", "cols")], "rows:2;cols:3", mtf.Dimension("d", 9)) == 3
    with pytest.raises(ValueError, match="divide"):
        mtf.tensor_dim_to_size_per_split("d:cols", "rows:2;cols:3", mtf.Dimension("d", 8))


def test_small_helpers():
    assert mtf.list_product([2, 3, 4]) == 24 and mtf.list_product([]) == 1
    assert mtf.transpose_list_of_lists([[1, 2, 3], [4, 5, 6]]) == [[1, 4], [2, 5], [3, 6]]
    with pytest.raises(ValueError):
        mtf.transpose_list_of_lists([])
    assert mtf.is_subsequence("ace", "abcde") and not mtf.is_subsequence("aec", "abcde")
    assert mtf.is_subsequence([], [1]) and mtf.is_subsequence([1, 2], [1, 2])
    a, b = mtf.Dimension("a", 2), mtf.Dimension("b", 3)
    mtf.verify_no_new_dims([mtf.Shape([a]), mtf.Shape([b])], mtf.Shape([b, a]))
    with pytest.raises(ValueError, match="No new dimensions"):
        mtf.verify_no_new_dims([mtf.Shape([a])], mtf.Shape([a, b]))
    assert mtf.combined_dimension([a, b]) == mtf.Dimension("a", 6)
    assert mtf.combined_dimension([a, b], name="ab") == mtf.Dimension("ab", 6)
    assert [d.name for d in mtf.anonymous_shape([a, b])] == ["_anonymous_0", "_anonymous_1"]
    assert mtf.convert_to_layout_rules("batch:rows").pairs == (("batch", "rows"),)
    assert mtf.LayoutRules(pairs=[("d", "x")]).pairs == (("d", "x"),)


def test_pretty_print_counters_totals_prefixes():
    text = mtf.pretty_print_counters([("einsum", 4.0), ("einsum/flops", 2.0), ("allreduce/bytes", 1000.0)])
    assert text.splitlines() == ["allreduce: 1e+03", " allreduce/bytes: 1e+03", "einsum: 6", " einsum/flops: 2"]
