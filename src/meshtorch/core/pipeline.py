"""The pipeline schedule as data: which microbatch each stage works on at each iteration.

A pipelined layer stack (:func:`meshtorch.layers.pipeline.pipeline`) runs ``S`` stages on a state buffer
``[stage, ...]``; at every iteration each stage applies its layer to its slot and the buffer shifts one
stage forward. Microbatch ``m`` enters stage 0 at iteration ``r * M + m`` for repeat ``r`` (circular
schedule, ``R`` repeats: layer ``r * S + s`` runs on stage ``s``), so stage ``s`` works at iteration ``t``
on work item ``k = t - s`` (microbatch ``k % M``, repeat ``k // M``) when ``0 <= k < M * R``, and idles
(a bubble) otherwise. This is GPipe's fill-drain schedule (Huang et al. 2019) for ``R = 1`` and the
circular schedule of praxis' ``CircularLayerwiseShardablePipelined`` / MaxText's ``Pipeline`` for
``R > 1`` (which needs ``M >= S``: a microbatch's next repeat enters stage 0 only after its previous
repeat left the last stage).

Pure metadata, no graph: the planner reads it from ``LMGraph.pipeline`` / ``graph.pipeline_schedule``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["HF_STACKED_NAMES", "LM_STACKED_NAMES", "T5_STACKED_NAMES", "PipelineSchedule", "StackedNames",
           "resolve_pipeline_fields"]


@dataclass(frozen=True)
class PipelineSchedule:
    """``stages`` (S) x ``microbatches`` (M) x ``repeats`` (R) pipeline schedule.

    Raises:
        ValueError: a count below 1, or ``repeats > 1`` with ``microbatches < stages``.
    """

    stages: int
    microbatches: int = 1
    repeats: int = 1

    def __post_init__(self):
        for field in ("stages", "microbatches", "repeats"):
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"PipelineSchedule: {field} must be an int >= 1, got {v!r}.")
        if self.repeats > 1 and self.microbatches < self.stages:
            raise ValueError(f"PipelineSchedule: circular repeats ({self.repeats}) need microbatches >= stages, got "
                             f"{self.microbatches} < {self.stages}; raise microbatches.")

    def iterations(self) -> int:
        """Number of iterations of the loop: ``M * R + S - 1``."""
        return self.microbatches * self.repeats + self.stages - 1

    def bubble_fraction(self) -> float:
        """Fraction of (iteration, stage) slots that idle: ``(S - 1) / (M * R + S - 1)``."""
        return (self.stages - 1) / self.iterations()

    def work(self, iteration: int, stage: int) -> tuple[int, int] | None:
        """``(microbatch, repeat)`` that ``stage`` processes at ``iteration``, or None in a bubble."""
        k = iteration - stage
        if 0 <= k < self.microbatches * self.repeats:
            return k % self.microbatches, k // self.microbatches
        return None

    def layer(self, stage: int, repeat: int) -> int:
        """Index of the (unpipelined) layer that ``stage`` runs in ``repeat``: ``repeat * S + stage``."""
        return StackedNames.index(stage, repeat, self.stages)

    def table(self) -> list[list[int | None]]:
        """The schedule: one row per iteration, one entry per stage, the microbatch index or None (a bubble)."""
        return [[None if (w := self.work(t, s)) is None else w[0] for s in range(self.stages)]
                for t in range(self.iterations())]

    def valid(self, iteration: int) -> list[bool]:
        """Per stage: whether it works (not a bubble) at ``iteration``."""
        return [self.work(iteration, s) is not None for s in range(self.stages)]

    def outputs_at(self, iteration: int) -> int | None:
        """The microbatch whose final output (last stage, last repeat) is produced at ``iteration``, or None."""
        w = self.work(iteration, self.stages - 1)
        return w[0] if w is not None and w[1] == self.repeats - 1 else None


def resolve_pipeline_fields(stage_axis_size: int, stages: int | None, microbatches: int | None,
                            repeats: int | None, num_layers: int | None) -> dict:
    """The pipeline fields of ``LMConfig`` that ``--pipeline-stages``, ``--microbatches`` and ``--pipeline-repeats``
    (None: not given) resolve to, the one rule ``meshtorch train`` and ``meshtorch plan`` share: ``S`` =
    ``stages`` or ``stage_axis_size`` (the size of the mesh axis the layout maps ``stage`` to, 1 if none),
    ``M`` = ``microbatches`` or ``S``, ``R`` = ``repeats`` or ``num_layers / S`` (every layer stacked; 1 when
    ``S`` does not divide the layers, which the caller then refuses).

    Returns:
        ``{"pipeline_stages": S, "microbatches": M, "pipeline_repeats": R}``, or ``{}`` when ``S <= 1`` (no
        pipeline). No validation: see :func:`meshtorch.runtime.checks.pipeline_fields`.
    """
    stages = stage_axis_size if stages is None else stages
    if stages <= 1:
        return {}
    if repeats is None:
        repeats = num_layers // stages if num_layers and num_layers % stages == 0 else 1
    return {"pipeline_stages": stages, "microbatches": microbatches or stages, "pipeline_repeats": repeats}


@dataclass(frozen=True)
class StackedNames:
    """How a pipelined layer stack's variables are named against the unpipelined layers' (pure metadata).

    Unpipelined, layer ``i`` has variables ``{layer_format.format(i)}/{kind}`` (``layer_3/attention/q``); pipelined
    (:func:`meshtorch.layers.pipeline.pipeline`), one variable ``{prefix}/{kind}`` of shape ``[stage, (repeat,)
    kind's shape...]`` holds them all, row ``[s, r]`` being layer ``r * S + s`` (:meth:`PipelineSchedule.layer`).
    An optimizer slot named after its variable (``{var}/adam_m``, ``{var}_slot_v``) follows it. A graph whose
    ``stacked_names`` attribute is one of these restores checkpoints written under the other naming
    (:func:`meshtorch.checkpoint.restore`)."""

    prefix: str = "stack"
    layer_format: str = "layer_{}"
    stage_dim: str = "stage"
    repeat_dim: str = "repeat"

    def layer_name(self, i: int) -> str:
        """The name of unpipelined layer ``i`` (``layer_{i}``)."""
        return self.layer_format.format(i)

    def unstacked(self, name: str, index: int) -> str | None:
        """Layer ``index``'s name of the stacked variable (or slot) ``name``, or None if ``name`` is not stacked."""
        if not name.startswith(self.prefix + "/"):
            return None
        return self.layer_name(index) + name[len(self.prefix):]

    def stacked(self, name: str) -> tuple[int, str] | None:
        """``(layer index, stacked name)`` of the per-layer variable (or slot) ``name``, or None if it is not one."""
        parts = name.split("/")
        n = self.layer_format.count("/") + 1  # the path components that name a layer (``encoder/block_{:03d}``)
        if len(parts) <= n:
            return None
        head, rest = "/".join(parts[:n]), "/".join(parts[n:])
        before, _, tail = self.layer_format.partition("{")
        after = tail.partition("}")[2]
        digits = head[len(before):len(head) - len(after)] if head.startswith(before) and head.endswith(after) else ""
        if not digits.isdigit() or self.layer_name(int(digits)) != head:
            return None
        return int(digits), f"{self.prefix}/{rest}"

    @staticmethod
    def position(index: int, stages: int) -> tuple[int, int]:
        """``(stage, repeat)`` of layer ``index`` in an ``stages``-stage stack: ``(index mod S, index div S)``."""
        return index % stages, index // stages

    @staticmethod
    def index(stage: int, repeat: int, stages: int) -> int:
        """The layer at ``(stage, repeat)``: ``repeat * S + stage``."""
        return repeat * stages + stage


#: the native LM's naming (``models.transformer.build_lm``, ``models.lm_stages``)
LM_STACKED_NAMES = StackedNames()
#: T5's encoder and decoder stacks (``models.hf_t5.build_t5``: ``encoder/block_003/layer_000/SelfAttention/q`` <->
#: ``encoder/stack/layer_000/SelfAttention/q``; the relative bias table, only in ``block_000``, is not stacked)
T5_STACKED_NAMES = (StackedNames("encoder/stack", "encoder/block_{:03d}"),
                    StackedNames("decoder/stack", "decoder/block_{:03d}"))
#: the imported decoder-only models' naming (``models.hf.build_hf_lm``: ``layers{i}/attn/q/kernel`` <->
#: ``stack/attn/q/kernel``)
HF_STACKED_NAMES = StackedNames(layer_format="layers{}")
