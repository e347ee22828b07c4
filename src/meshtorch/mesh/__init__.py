"""Mesh implementations: the MeshImpl interface and the single-process PlacementMeshImpl."""

from meshtorch.mesh.base import MeshImpl
from meshtorch.mesh.placement import PlacementMeshImpl

__all__ = ["MeshImpl", "PlacementMeshImpl"]
