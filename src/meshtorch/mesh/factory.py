"""The mesh implementation for how this process was started (one program, either way)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from meshtorch.core.mesh_spec import MeshSpec
from meshtorch.mesh.base import MeshImpl
from meshtorch.mesh.placement import PlacementMeshImpl
from meshtorch.mesh.process import init_distributed
from meshtorch.mesh.spmd import SpmdMeshImpl


def make_mesh_impl(mesh_shape, layout, device=None, storage=None, async_collectives: bool | None = None) -> MeshImpl:
    """The mesh implementation for how this process was started.

    Under torchrun / ``meshtorch launch`` (``WORLD_SIZE`` > 1): initializes ``torch.distributed`` if
    needed and returns ``SpmdMeshImpl(mesh_shape, layout, device)`` (the mesh size must equal the
    world size; ``device="cuda"``: ``cuda:LOCAL_RANK`` with NCCL, ``"cpu"``: gloo). Otherwise a
    ``PlacementMeshImpl(mesh_shape, layout)`` simulating the mesh in this one process (``device``, if
    given: :func:`placement_devices`, ``"cuda"`` spreading the processors over the visible GPUs).
    ``storage``: storage layout rules for variables (e.g. ``"d_model:data"``, see
    :class:`~meshtorch.mesh.base.MeshImpl`).
    ``async_collectives``: see :class:`~meshtorch.mesh.spmd.SpmdMeshImpl` (None: its default; the
    placement mesh has no communication to overlap and ignores it).
    """
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 or dist.is_initialized():
        init_distributed(backend=None if device is None else ("nccl" if str(device).startswith("cuda") else "gloo"))
        if str(device) == "cuda":  # one GPU per rank
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        return SpmdMeshImpl(mesh_shape, layout, device=device, storage=storage, async_collectives=async_collectives)
    return placement_mesh_impl(mesh_shape, layout, device=device, storage=storage)


def placement_mesh_impl(mesh_shape, layout="", device=None, storage=None) -> PlacementMeshImpl:
    """The mesh simulated in this one process, whatever the environment: ``PlacementMeshImpl(mesh_shape,
    layout, storage=storage)`` (``mesh_shape`` may be a :class:`~meshtorch.core.mesh_spec.MeshSpec`, then
    without layout or storage), its processors' slices on ``device`` (None: cpu; see
    :func:`placement_devices`, ``"cuda"`` spreading them over the visible GPUs)."""
    rules = {} if isinstance(mesh_shape, MeshSpec) else {"layout": layout, "storage": storage}
    if device is None:
        return PlacementMeshImpl(mesh_shape, **rules)
    size = (mesh_shape if isinstance(mesh_shape, MeshSpec) else MeshSpec(mesh_shape, layout or "")).size
    devices = placement_devices(device, size, torch.cuda.device_count() if str(device) == "cuda" else 0)
    return PlacementMeshImpl(mesh_shape, devices=devices, **rules)


def placement_devices(device, size: int, visible_gpus: int = 0) -> list[torch.device]:
    """The device of each of ``size`` simulated processors for ``device``: ``"cuda"`` (no index) spreads
    them over the ``visible_gpus`` GPUs round-robin (processor ``p`` on ``cuda:p % visible_gpus``: a
    ``all:4`` mesh on 4 GPUs puts one processor on each); any other device (``"cpu"``, ``"cuda:1"``) holds
    all of them."""
    if str(device) == "cuda" and visible_gpus > 0:
        return [torch.device("cuda", p % visible_gpus) for p in range(size)]
    return [torch.device(device)] * size
