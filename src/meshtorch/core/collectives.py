"""Each collective declared once: one :class:`CollectiveKind` record per kind, read by every pass.

A collective step of a program (:class:`~meshtorch.lowering.program.Step`) names its kind by a string
(``"allreduce"``, ``"allgather"``, ``"reduce_scatter"``, ``"alltoall"``, ``"collective_permute"``,
``"broadcast"``; a bucket of several is ``"<kind>_bucket"``, :mod:`~meshtorch.lowering.schedule`).
Everything a pass needs to know about a kind lives in its record here, in the style of JAX's
collective primitives (shape rule and lowering registered together), instead of string switches spread
over the executor, the scheduler, the donation and memory walks, the SPMD strategy, the calibration and
the cost model. The table lives in ``core`` (plain data, no torch) so that the backends
(:class:`~meshtorch.mesh.base.MeshImpl` subclasses) are checked against it when their class is
defined; :mod:`meshtorch.lowering.collectives` re-exports it for the passes.

- ``method`` / ``bucket_method``: the :class:`~meshtorch.mesh.base.MeshImpl` primitive the executor
  calls for one collective / for a bucket of them (every backend class must define ``method``);
- ``output_bytes(b, group)``: the local output's bytes given the input slice's ``b`` bytes (the shape
  rule, in bytes: the memory walk sizes slots with it);
- ``wire_bytes(b, group)``: bytes each processor sends in the usual ring algorithm (the cost model);
- ``workspace(params, in_b, out_b)`` / ``bucket_workspace``: bytes the SPMD implementation holds
  beyond the outputs while the call runs (packing, moved copies; the memory walk);
- ``bucket``: the bucket step kind, None if the kind is never bucketed; ``bucket_params(steps)``: a
  bucket step's parameters; ``bucket_key(step)``: which reductions may share a bucket (None: none);
- ``hoisted``: reductions moved up to just after their input's producer (:func:`~meshtorch.lowering.
  program.hoist_collectives`); ``weight_gather``: an all-gather FSDP buckets and prefetches;
- ``first_bucket``: a group of its buckets opens with DDP's small first bucket (``schedule.bucket_reductions``);
  ``fp32_default_buckets``: the Lowering's default buckets are off when a program runs this kind on a
  tensor narrower than 32 bits;
- ``donatable``: its single output may be written into its input's buffer when the program reads the input
  nowhere else (``donate=True``; the memory walk then counts no new output); ``fresh_output``: its
  output is a new tensor, sharing no storage with the input, when its group has more than one member;
- ``async_when_large``: the SPMD eager strategy's size threshold (``async_all_reduce_min_bytes``) starts
  calls of this kind asynchronously from that many bytes (DDP's overlapped gradient buckets);
- ``calibrate``: the primitive's keyword arguments on a mesh of one axis, for ``meshtorch plan
  --calibrate`` to time it (None: not measured).

:func:`kind_of` looks a step kind up and raises ValueError for an unknown one: a new collective that is
not declared here fails at once, never falls through a default.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class CollectiveKind:
    """One collective kind: see the module docstring for the fields."""

    name: str
    method: str
    output_bytes: Callable[[int, int], int]
    wire_bytes: Callable[[int, int], float]
    workspace: Callable[[dict, list, list], int]
    hoisted: bool = False
    weight_gather: bool = False
    bucket: str | None = None
    bucket_method: str | None = None
    bucket_params: Callable[[list], dict] | None = None
    bucket_key: Callable[[object], tuple | None] | None = None
    bucket_workspace: Callable[[dict, list, list], int] | None = None
    first_bucket: bool = False
    fp32_default_buckets: bool = False
    donatable: bool = False
    fresh_output: bool = False
    async_when_large: bool = False
    calibrate: dict | None = None


def _none(params, in_b, out_b) -> int:
    return 0


def _same(b, group) -> int:
    return b


def _allreduce_bucket_key(st):
    return (st.mesh, "allreduce", tuple(st.params["mesh_axes"])) if st.params.get("reduction") == "SUM" else None


KINDS: dict[str, CollectiveKind] = {c.name: c for c in (
    CollectiveKind(
        "allreduce", "allreduce", _same, lambda b, g: 2 * (g - 1) / g * b, _none,
        hoisted=True, first_bucket=True, fp32_default_buckets=True, donatable=True, async_when_large=True,
        calibrate={"mesh_axes": [0]}, bucket="allreduce_bucket", bucket_method="allreduce_many",
        bucket_params=lambda sts: {"mesh_axes": tuple(sts[0].params["mesh_axes"]), "reduction": "SUM"},
        bucket_key=_allreduce_bucket_key, bucket_workspace=_none),
    CollectiveKind(
        "allgather", "all_gather", lambda b, g: b * g, lambda b, g: (g - 1) * b,
        # the flat gather, then the reordered copy (none when the pieces concatenate on axis 0)
        lambda p, in_b, out_b: sum(out_b) if p.get("concat_axis") else 0,
        weight_gather=True, fresh_output=True, calibrate={"mesh_axis": 0, "concat_axis": 0},
        bucket="allgather_bucket", bucket_method="all_gather_many",
        bucket_params=lambda sts: {"mesh_axis": sts[0].params["mesh_axis"],
                                   "concat_axes": tuple(st.params["concat_axis"] for st in sts)},
        bucket_key=lambda st: None,  # weight gathers are bucketed by bucket_gathers, in plan order
        bucket_workspace=lambda p, in_b, out_b: sum(in_b) + sum(out_b)),  # packed slices + gathered flat buffer
    CollectiveKind(
        "reduce_scatter", "reduce_scatter", lambda b, g: b // g, lambda b, g: (g - 1) / g * b,
        lambda p, in_b, out_b: sum(in_b) if p.get("scatter_axis") else 0,  # the scatter axis moved to the front
        hoisted=True, calibrate={"mesh_axis": 0, "scatter_axis": 0}, bucket="reduce_scatter_bucket",
        bucket_method="reduce_scatter_many",
        bucket_params=lambda sts: {"mesh_axis": sts[0].params["mesh_axis"],
                                   "scatter_axes": tuple(st.params["scatter_axis"] for st in sts)},
        bucket_key=lambda st: (st.mesh, "reduce_scatter", st.params["mesh_axis"]),
        # the packed rows (each member copied in once, whatever its scatter axis)
        bucket_workspace=lambda p, in_b, out_b: sum(in_b)),
    CollectiveKind(
        "alltoall", "alltoall", _same, lambda b, g: (g - 1) / g * b,
        lambda p, in_b, out_b: 2 * sum(in_b),  # the moved send buffer and the receive buffer
        calibrate={"mesh_axis": 0, "split_axis": 0, "concat_axis": 0}),
    CollectiveKind("collective_permute", "collective_permute", _same, lambda b, g: b, _none),
    # one member's slice to the whole group (params: mesh_axis, root): a process-group broadcast, whose
    # pipelined (ring or tree) algorithm sends each byte about once per processor
    CollectiveKind("broadcast", "broadcast", _same, lambda b, g: b, _none),
)}

#: bucket step kind -> the record of the kind it buckets
BUCKETS: dict[str, CollectiveKind] = {c.bucket: c for c in KINDS.values() if c.bucket}


def kind_of(step_kind: str) -> tuple[CollectiveKind, bool]:
    """``(record, is_bucket)`` of a collective step kind (``"allreduce"`` or ``"allreduce_bucket"``).

    Raises:
        ValueError: naming the kind and the declared ones, if it is no declared collective.
    """
    c = KINDS.get(step_kind)
    if c is not None:
        return c, False
    c = BUCKETS.get(step_kind)
    if c is not None:
        return c, True
    raise ValueError(f"unknown collective kind {step_kind!r}; declared: {sorted(KINDS)} and their buckets "
                     f"{sorted(BUCKETS)} (meshtorch.core.collectives).")


def is_collective(step_kind: str) -> bool:
    """True for a declared collective step kind, single or bucket."""
    return step_kind in KINDS or step_kind in BUCKETS


__all__ = ["BUCKETS", "KINDS", "CollectiveKind", "is_collective", "kind_of"]
