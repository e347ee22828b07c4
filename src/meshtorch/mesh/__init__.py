"""Mesh implementations: the MeshImpl interface, the single-process PlacementMeshImpl and the
one-process-per-processor SpmdMeshImpl (torch.distributed; its collectives issued by an eager or a
functional strategy, ``spmd_strategy``); process groups (``process``), the
failure watchdog (``watchdog``), the flight recorder of executed collectives (``recorder``) and
:func:`make_mesh_impl` (SPMD under torchrun, else placement)."""

from meshtorch.mesh.base import MeshImpl
from meshtorch.mesh.factory import make_mesh_impl
from meshtorch.mesh.placement import PlacementMeshImpl
from meshtorch.mesh.process import init_distributed, is_main_process, shutdown_distributed
from meshtorch.mesh.recorder import CollectiveRecord, FlightRecorder, collective_report, flight_recorder
from meshtorch.mesh.spmd import SpmdMeshImpl

__all__ = ["CollectiveRecord", "FlightRecorder", "MeshImpl", "PlacementMeshImpl",
           "SpmdMeshImpl", "init_distributed",
           "collective_report", "flight_recorder", "is_main_process", "make_mesh_impl", "shutdown_distributed"]
