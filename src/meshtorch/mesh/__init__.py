"""Mesh implementations: the MeshImpl interface, the single-process PlacementMeshImpl and the
one-process-per-processor SpmdMeshImpl (torch.distributed)."""

from meshtorch.mesh.base import MeshImpl
from meshtorch.mesh.placement import PlacementMeshImpl
from meshtorch.mesh.spmd import SpmdMeshImpl

__all__ = ["MeshImpl", "PlacementMeshImpl", "SpmdMeshImpl"]
