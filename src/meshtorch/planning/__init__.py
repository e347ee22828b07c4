"""Planning before running: memory, FLOPs and communication of one run, and a layout search.

Everything here reads a planned program (:func:`meshtorch.lowering.stages.plan`: no backend, no variable
storage, nothing runs), so a model too big for this machine can still be planned; nothing here reaches a
backend (:mod:`meshtorch.mesh`), not even through another module (import-linter contract).

* :mod:`~meshtorch.planning.memory`: :func:`memory_report` -> :class:`MemoryReport`.
* :mod:`~meshtorch.planning.cost`: :class:`CostModel` and :func:`estimate_time`, a simple
  alpha-beta model of one step's time; :func:`transform_time` prices a planned redistribution.
* :mod:`~meshtorch.planning.search`: :func:`search_layouts` ranks the legal layouts of a mesh.
* :mod:`~meshtorch.planning.budget`: :func:`check_memory_limit` fails an over-budget configuration
  before training, naming a storage rule (FSDP) that would fit.
* :mod:`~meshtorch.runtime.plan_lm`: :func:`~meshtorch.runtime.plan_lm.plan_lm`, what ``meshtorch plan``
  prints for the LM (its flags are read in :mod:`meshtorch.runtime.plan_command`).
* :mod:`~meshtorch.planning.pipeline`: :class:`PipelinePlan`, the pipeline section of a pipelined graph's
  report (bubble fraction, collectives over the stage axis, stacked vs other weights per processor).
"""

from meshtorch.planning.budget import MemoryLimitError, check_memory_limit, plan_memory
from meshtorch.planning.cost import CostModel, estimate_time, transform_time
from meshtorch.planning.memory import MemoryReport, memory_report
from meshtorch.planning.pipeline import PipelinePlan, pipeline_plan, schedule_table
from meshtorch.planning.search import candidate_layouts, graph_dimensions, search_layouts, storage_candidates

__all__ = ["CostModel", "MemoryLimitError", "MemoryReport", "PipelinePlan", "candidate_layouts", "check_memory_limit",
           "estimate_time", "graph_dimensions", "memory_report", "pipeline_plan", "plan_memory", "schedule_table",
           "search_layouts", "storage_candidates", "transform_time"]
