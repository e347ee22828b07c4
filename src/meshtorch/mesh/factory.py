"""The mesh implementation for how this process was started (one program, either way)."""

from __future__ import annotations

import os

import torch.distributed as dist

from meshtorch.mesh.base import MeshImpl
from meshtorch.mesh.placement import PlacementMeshImpl
from meshtorch.mesh.process import init_distributed
from meshtorch.mesh.spmd import SpmdMeshImpl


def make_mesh_impl(mesh_shape, layout, device=None, storage=None, async_collectives: bool | None = None) -> MeshImpl:
    """The mesh implementation for how this process was started.

    Under torchrun / ``meshtorch launch`` (``WORLD_SIZE`` > 1): initializes ``torch.distributed`` if
    needed and returns ``SpmdMeshImpl(mesh_shape, layout, device)`` (the mesh size must equal the
    world size). Otherwise a ``PlacementMeshImpl(mesh_shape, layout)`` simulating the mesh in this
    one process (``device``, if given, holds every processor's slices). ``storage``: storage layout
    rules for variables (e.g. ``"d_model:data"``, see :class:`~meshtorch.mesh.base.MeshImpl`).
    ``async_collectives``: see :class:`~meshtorch.mesh.spmd.SpmdMeshImpl` (None: its default; the
    placement mesh has no communication to overlap and ignores it).
    """
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 or dist.is_initialized():
        init_distributed()
        return SpmdMeshImpl(mesh_shape, layout, device=device, storage=storage, async_collectives=async_collectives)
    impl = PlacementMeshImpl(mesh_shape, layout, storage=storage)
    if device is not None:
        impl = PlacementMeshImpl(mesh_shape, layout, devices=[device] * impl.size, storage=storage)
    return impl
