"""Mesh TF's ``mtf.placement_mesh_impl`` module name: ``mtf.placement_mesh_impl.PlacementMeshImpl``."""

from meshtorch.mesh.placement import PlacementMeshImpl

__all__ = ["PlacementMeshImpl"]
