"""Collectives declared once (issue 22, deliverable 2): ``meshtorch.lowering.collectives``.

Every collective kind a program holds is declared in one record; the executor, the scheduler, the
memory walk and the cost model read it, and an undeclared kind is an error everywhere, never a
default. The records' shape rule (output bytes) is checked against what the placement mesh's
primitives actually return on random tensors.
"""

from __future__ import annotations

import pytest
import torch

import meshtorch as mtf
from _fsdp import BUCKET_BYTES, LAYOUTS, build
from meshtorch.lowering.collectives import BUCKETS, KINDS, kind_of
from meshtorch.lowering.counters import Collective
from meshtorch.lowering.executor import bind_step
from meshtorch.lowering.program import Step
from meshtorch.mesh.base import MeshImpl
from meshtorch.mesh.recorder import flight_recorder
from meshtorch.planning.cost import CostModel
from meshtorch.planning.memory import _workspace


def test_every_step_kind_of_an_fsdp_tp_plan_is_declared_with_a_primitive():
    mesh_shape, layout, storage = LAYOUTS["fsdp_tp"]
    lm, _, _, updates = build("adamw_clip")
    lw = mtf.Lowering(lm.graph, {lm.mesh: mtf.PlacementMeshImpl(mesh_shape, layout, storage=storage)},
                      bucket_bytes=BUCKET_BYTES, materialize=False)
    kinds = {st.kind for st in lw.plan([lm.loss] + updates).steps} - {"slicewise", "call"}
    assert {"allreduce_bucket", "allgather_bucket", "reduce_scatter_bucket"} <= kinds, kinds
    for k in kinds:
        c, bucket = kind_of(k)
        assert callable(getattr(MeshImpl, c.bucket_method if bucket else c.method))


def test_buckets_name_their_kind():
    assert set(BUCKETS) == {c.bucket for c in KINDS.values() if c.bucket}


@pytest.mark.parametrize("mesh_shape", ["all:4", "rows:2;cols:2"])
def test_output_bytes_rule_matches_the_primitives(mesh_shape):
    impl = mtf.PlacementMeshImpl(mesh_shape, "")
    g = torch.Generator().manual_seed(0)
    for axis in range(impl.ndims):
        n = impl.shape[axis].size
        x = [torch.randn(8, 4, generator=g) for _ in range(impl.size)]
        b = x[0].numel() * x[0].element_size()
        rec = flight_recorder()
        calls = {"allreduce": lambda: impl.allreduce(x, [axis]), "allgather": lambda: impl.all_gather(x, axis, 1),
                 "reduce_scatter": lambda: impl.reduce_scatter(x, axis, 0),
                 "alltoall": lambda: impl.alltoall(x, axis, 0, 1),
                 "collective_permute": lambda: impl.collective_permute(x, axis, [(c + 1) % n for c in range(n)]),
                 "broadcast": lambda: impl.broadcast(x, axis, n - 1)}
        assert set(calls) == set(KINDS)
        for kind, call in calls.items():
            out = call()
            assert KINDS[kind].output_bytes(b, n) == out[0].numel() * out[0].element_size(), (kind, axis)
            last = rec.records(last=1)[0]  # the backend records the declared kind's name, and the input bytes
            assert (last.kind, last.mesh_axes, last.parts) == (kind, (impl.shape[axis].name,), (b,))


def test_an_undeclared_kind_is_an_error_everywhere():
    impl = mtf.PlacementMeshImpl("all:2", "")
    st = Step("allscatter", "op", (0,), (1,), "m")
    with pytest.raises(ValueError, match="step of op 'op': unknown collective kind 'allscatter'"):
        bind_step(st, {"m": impl}, None)
    with pytest.raises(ValueError, match="unknown collective kind 'allscatter'"):
        CostModel().collective_time(Collective("allscatter", ("all",), "op", "t", 16, 2), 2)
    with pytest.raises(ValueError, match="unknown collective kind 'allscatter'"):
        _workspace(st, [16], [16])
    g = mtf.Graph()
    mesh = mtf.Mesh(g)
    x = mtf.get_variable(mesh, "x", "b:4", initializer=0.0)
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("all:2", "b:all")}, materialize=False)
    with pytest.raises(ValueError, match="Planner.collective: unknown collective kind 'allscatter'"):
        lw.planner.collective("allscatter", 0, x, [0], [2])


def test_a_backend_without_a_declared_primitive_fails_when_its_class_is_defined():
    """Backends are checked against the record table at class definition (import): each kind's ``method`` must
    be the class's own (not :class:`MeshImpl`'s stub), its ``bucket_method`` present; the error names the kind."""
    methods = {name: getattr(mtf.PlacementMeshImpl, name)
               for c in KINDS.values() for name in (c.method, c.bucket_method) if name}
    for c in KINDS.values():
        with pytest.raises(TypeError, match=rf"does not implement '{c.method}', the primitive of the collective "
                                            rf"kind '{c.name}'"):
            type("Partial", (MeshImpl,), {k: v for k, v in methods.items() if k != c.method})
    assert issubclass(type("Whole", (MeshImpl,), methods), MeshImpl)
