"""Pipeline schedules as data: the order of forward and backward actions per rank, timed into a table.

A schedule of ``S`` ranks (pipeline stages), ``M`` microbatches and ``R`` virtual stages per rank (the
*repeats*: rank ``r`` holds virtual stages ``r, S + r, ..., (R-1) S + r``, layer ``v`` of ``V = S R`` on rank
``v mod S``) is, per rank, a sequence of :class:`Action`\\ s: the forward ``F`` of microbatch ``m`` through
virtual stage ``v``, its backward ``B``, or, for zero-bubble schedules, the backward split into the input
gradient ``I`` (what the previous stage waits for) and the weight gradient ``W`` (which can fill a bubble).
This is the action notation of ``torch.distributed.pipelining`` (``_Action``: ``"2F0"`` = stage 2 forward of
microbatch 0; ``_ComputationType`` ``F``/``B``/``I``/``W``); the named schedules give the same per-rank orders as
its ``pipeline_order`` (``tests/test_pipeline_schedules.py`` compares them):

* ``gpipe`` (Huang et al. 2019; torch ``ScheduleGPipe``): every forward, then every backward (microbatch
  order). With ``R > 1``, breadth-first looping (Lamy-Poirier 2023; torch ``ScheduleLoopedBFS``): every
  microbatch through a rank's first virtual stage, then its next; backwards in reverse.
* ``1f1b`` (PipeDream-Flush, Narayanan et al. 2021; torch ``Schedule1F1B``): ``S-1-r`` warm-up forwards,
  then one forward and one backward alternately, then the remaining backwards: at most ``S - r``
  microbatches in flight on rank ``r`` (GPipe keeps ``M``). ``R = 1`` only.
* ``interleaved-1f1b`` (Megatron-LM, Narayanan et al. 2021 section 2.2; torch ``ScheduleInterleaved1F1B``):
  1F1B over ``R >= 2`` virtual stages per rank, microbatches in rounds of ``M / max(1, M // S)``.
* ``zero-bubble`` (ZB-H1 / ZB1P, Qi et al. 2024; torch ``ScheduleInterleavedZeroBubble``): interleaved 1F1B
  with ``B`` split into ``I`` and ``W``; rank ``r`` defers its weight gradients by ``r`` steps and spends them
  in the drain. ``R >= 1``.

:meth:`ScheduleTable.timed` places each rank's actions on unit time steps as soon as their inputs exist
(every action one step; a value sent at step ``t`` is usable at ``t + 1``): the table ``meshtorch plan
--schedule --pipeline-schedule NAME`` prints, whose idle slots give :meth:`ScheduleTable.bubble_fraction`
(GPipe and 1F1B: ``(S-1)/(M+S-1)``; interleaved 1F1B: ``(S-1)/(R M+S-1)``). Pure metadata, no graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

__all__ = ["SCHEDULES", "Action", "ScheduleTable", "build_schedule", "check_schedule"]

#: the schedule names ``--pipeline-schedule`` takes
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")


class Action(NamedTuple):
    """One step of one rank: ``kind`` (``"F"`` forward, ``"B"`` full backward, ``"I"`` input gradient, ``"W"``
    weight gradient) of ``microbatch`` through virtual ``stage`` (0..S R - 1); ``str`` is torch's ``"2F0"``."""

    stage: int
    kind: str
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"


def check_schedule(name: str, stages: int, microbatches: int, repeats: int = 1) -> None:
    """Refuse a schedule that cannot run ``stages`` (S) x ``microbatches`` (M) x ``repeats`` (R).

    Raises:
        ValueError: one line naming the schedule and what to change: an unknown name; a count below 1;
            ``1f1b`` with ``R > 1``; ``interleaved-1f1b`` with ``R < 2``; ``1f1b``, ``interleaved-1f1b`` and
            ``zero-bubble`` with ``M < S``; the interleaved ones with ``M`` not a multiple of their rounds
            ``max(1, M // S)`` (torch's rule).
    """
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(SCHEDULES)}.")
    for what, v in (("stages", stages), ("microbatches", microbatches), ("repeats", repeats)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"pipeline schedule {name}: {what} must be an int >= 1, got {v!r}.")
    if name == "1f1b" and repeats > 1:
        raise ValueError(f"pipeline schedule 1f1b runs one stage per rank, got {repeats} repeats; use "
                         "interleaved-1f1b (or zero-bubble) for repeats > 1.")
    if name == "interleaved-1f1b" and repeats < 2:
        raise ValueError("pipeline schedule interleaved-1f1b needs repeats >= 2 (virtual stages per rank); use 1f1b "
                         "for one stage per rank.")
    if name != "gpipe" and microbatches < stages:
        raise ValueError(f"pipeline schedule {name} needs microbatches >= stages, got {microbatches} < {stages}.")
    rounds = max(1, microbatches // stages)
    if name in ("interleaved-1f1b", "zero-bubble") and microbatches % rounds:
        raise ValueError(f"pipeline schedule {name}: microbatches ({microbatches}) must be a multiple of its rounds "
                         f"max(1, microbatches // stages) = {rounds}; use a multiple of {stages}.")


def _gpipe(S: int, M: int, R: int, r: int) -> list[Action]:
    chunks = [c * S + r for c in range(R)]
    fwd = [Action(v, "F", m) for v in chunks for m in range(M)]
    if R == 1:
        return fwd + [Action(r, "B", m) for m in range(M)]
    return fwd + [Action(v, "B", m) for v in reversed(chunks) for m in reversed(range(M))]


def _one_f_one_b(S: int, M: int, r: int) -> list[Action]:
    warm = S - 1 - r
    out = [Action(r, "F", m) for m in range(warm)]
    for i in range(M - warm):
        out += [Action(r, "F", warm + i), Action(r, "B", i)]
    return out + [Action(r, "B", m) for m in range(M - warm, M)]


def _interleaved(S: int, M: int, R: int, r: int, zero_bubble: bool) -> list[Action]:
    """Megatron's interleaved 1F1B in torch's flexible-rounds form; ``zero_bubble``: ZB1P (I then deferred W)."""
    per_round = M // max(1, M // S)
    total = R * M
    warm = min((R - 1) * per_round + (1 if zero_bubble else 2) * (S - 1 - r), total)

    def fwd(k: int) -> Action:  # the k-th forward of the rank: rounds of per_round microbatches per chunk
        return Action((k // per_round) % R * S + r, "F", k // (per_round * R) * per_round + k % per_round)

    def bwd(j: int) -> Action:  # the j-th backward: the chunks in reverse
        return Action((R - 1 - (j // per_round) % R) * S + r, "I" if zero_bubble else "B",
                      j // (per_round * R) * per_round + j % per_round)

    out = [fwd(k) for k in range(warm)]
    done_w = 0
    for j in range(total):  # backward j pairs with forward warm + j while there is one
        if warm + j < total:
            out.append(fwd(warm + j))
        out.append(bwd(j))
        if zero_bubble and j >= r:  # ZB1P: rank r holds back r weight gradients, the rest follow their I
            out.append(bwd(done_w)._replace(kind="W"))
            done_w += 1
    if zero_bubble:
        out += [bwd(j)._replace(kind="W") for j in range(done_w, total)]
    return out


@dataclass(frozen=True)
class ScheduleTable:
    """The named schedule of ``stages`` ranks x ``microbatches`` x ``repeats`` virtual stages per rank.

    Attributes:
        name: one of :data:`SCHEDULES`.
        stages, microbatches, repeats: ``S``, ``M``, ``R``.
        order: per rank, its actions in execution order (``order[r]``).
    """

    name: str
    stages: int
    microbatches: int
    repeats: int
    order: tuple[tuple[Action, ...], ...]

    @property
    def virtual_stages(self) -> int:
        """``S R``: the model's layers (or layer groups) in pipeline order."""
        return self.stages * self.repeats

    def rank_of(self, stage: int) -> int:
        """The rank that runs virtual ``stage``: ``stage mod S``."""
        return stage % self.stages

    def _deps(self, a: Action) -> list[Action]:
        V = self.virtual_stages
        if a.kind == "F":
            return [Action(a.stage - 1, "F", a.microbatch)] if a.stage > 0 else []
        if a.kind == "W":
            return [Action(a.stage, "I", a.microbatch)]
        deps = [Action(a.stage, "F", a.microbatch)]
        if a.stage < V - 1:
            deps.append(Action(a.stage + 1, a.kind, a.microbatch))
        return deps

    @cached_property
    def timed(self) -> tuple[tuple[Action | None, ...], ...]:
        """The table: one row per unit time step, one entry per rank, the action it runs or None (idle).

        Each rank runs its :attr:`order`; an action starts at the first step after everything it needs
        (the previous virtual stage's forward; the next one's backward and its own forward; for ``W`` its
        ``I``) has finished on other ranks, one step per action.

        Raises:
            ValueError: the order deadlocks (an action waits for one that never runs first).
        """
        S = self.stages
        pos = [0] * S
        done: set[Action] = set()
        rows: list[tuple[Action | None, ...]] = []
        while any(pos[r] < len(self.order[r]) for r in range(S)):
            row: list[Action | None] = []
            for r in range(S):
                a = self.order[r][pos[r]] if pos[r] < len(self.order[r]) else None
                if a is not None and all(d in done for d in self._deps(a)):
                    pos[r] += 1
                    row.append(a)
                else:
                    row.append(None)
            if all(a is None for a in row):
                stuck = [str(self.order[r][pos[r]]) for r in range(S) if pos[r] < len(self.order[r])]
                raise ValueError(f"pipeline schedule {self.name}: deadlock at step {len(rows)} waiting on {stuck}.")
            done.update(a for a in row if a is not None)
            rows.append(tuple(row))
        return tuple(rows)

    @property
    def steps(self) -> int:
        """Time steps of the table (the makespan in units of one action)."""
        return len(self.timed)

    def bubble_fraction(self) -> float:
        """The idle share of the table's (step, rank) slots: ``1 - actions / (S x steps)``."""
        work = sum(len(o) for o in self.order)
        return 1 - work / (self.stages * self.steps)

    def weighted(self, cost) -> tuple[float, float]:
        """``(makespan, bubble fraction)`` when action ``a`` takes ``cost(a) >= 0`` time units (e.g. its FLOPs)
        instead of one step: each rank runs its :attr:`order`, an action starting when the rank is free and what
        it needs (as :attr:`timed`) has finished; the bubble is the idle share ``1 - sum(cost) / (S x makespan)``.
        With ``cost = lambda a: 1`` this is :attr:`steps` and :meth:`bubble_fraction`."""
        S, end, free, pos = self.stages, {}, [0.0] * self.stages, [0] * self.stages
        while any(pos[r] < len(self.order[r]) for r in range(S)):
            moved = False
            for r in range(S):
                while pos[r] < len(self.order[r]) and all(d in end for d in self._deps(self.order[r][pos[r]])):
                    a = self.order[r][pos[r]]
                    start = max([free[r]] + [end[d] for d in self._deps(a)])
                    end[a] = free[r] = start + float(cost(a))
                    pos[r] += 1
                    moved = True
            if not moved:
                self.timed  # noqa: B018 - raises the deadlock's ValueError
        span = max(free)
        work = sum(float(cost(a)) for o in self.order for a in o)
        return span, (1 - work / (S * span) if span else 0.0)

    def in_flight(self) -> list[int]:
        """Per rank, the peak number of (virtual stage, microbatch) activations held: one from its ``F`` until
        its ``B`` (zero-bubble: its ``W``, the last use of the stage's inputs). GPipe: ``M R``; 1F1B: ``S - r``."""
        out = []
        for acts in self.order:
            n = peak = 0
            for a in acts:
                n += 1 if a.kind == "F" else -1 if a.kind in ("B", "W") else 0
                peak = max(peak, n)
            out.append(peak)
        return out

    def sends(self) -> list[tuple[int, int, int, Action]]:
        """The point-to-point transfers between ranks: ``(step, from rank, to rank, action)`` for each forward
        output to the next virtual stage's rank and each input gradient (``B`` or ``I``) to the previous
        virtual stage's rank, when the two ranks differ; ``step`` is when the producing action runs."""
        V, out = self.virtual_stages, []
        for t, row in enumerate(self.timed):
            for r, a in enumerate(row):
                if a is None:
                    continue
                if a.kind == "F" and a.stage < V - 1 and self.rank_of(a.stage + 1) != r:
                    out.append((t, r, self.rank_of(a.stage + 1), a))
                elif a.kind in ("B", "I") and a.stage > 0 and self.rank_of(a.stage - 1) != r:
                    out.append((t, r, self.rank_of(a.stage - 1), a))
        return out

    def receiver(self, a: Action) -> Action | None:
        """The action that receives what ``a`` sends to another rank (the next virtual stage's ``F`` of a
        forward's output, the previous one's ``B``/``I`` of an input gradient), or None when ``a`` sends nothing
        to another rank (the last stage's ``F``, stage 0's or a ``W``, a neighbour on the same rank)."""
        r, V = self.rank_of(a.stage), self.virtual_stages
        if a.kind == "F" and a.stage < V - 1:
            to = Action(a.stage + 1, "F", a.microbatch)
        elif a.kind in ("B", "I") and a.stage > 0:
            to = Action(a.stage - 1, a.kind, a.microbatch)
        else:
            return None
        return to if self.rank_of(to.stage) != r else None

    @cached_property
    def send_waits(self) -> tuple[tuple[tuple[Action, ...], ...], ...]:
        """``send_waits[r][k]``: the earlier actions of rank ``r`` whose sends it can wait for (and free) once
        action ``order[r][k]`` has received its input from another rank, because that input proves the sends
        were received: the message was sent after its sender had (transitively, through the messages and each
        rank's order) run the sends' receiving actions. Waiting there never blocks on a receive not yet posted,
        so it adds no deadlock even where the transport only completes a send once the receiver posts it (gloo's
        TCP pairs). Computed with vector clocks over :attr:`timed` (Lamport 1978 / Mattern 1989): per rank the
        last action index of every rank known to have finished; a sent transfer whose receiving action's index is
        known finished is released. Sends never proven received are waited for at the step's end."""
        S = self.stages
        index = [{a: k for k, a in enumerate(o)} for o in self.order]
        clock = [[-1] * S for _ in range(S)]
        after: dict[Action, list[int]] = {}  # action -> its rank's clock once it finished
        pending: list[list[Action]] = [[] for _ in range(S)]
        out = [[()] * len(o) for o in self.order]
        for row in self.timed:
            for r, a in enumerate(row):
                if a is None:
                    continue
                k = index[r][a]
                for d in self._deps(a):
                    if self.rank_of(d.stage) != r:
                        clock[r] = [max(x, y) for x, y in zip(clock[r], after[d], strict=True)]
                clock[r][r] = k
                known = []
                for s in pending[r]:
                    to = self.receiver(s)
                    if clock[r][self.rank_of(to.stage)] >= index[self.rank_of(to.stage)][to]:
                        known.append(s)
                out[r][k] = tuple(known)
                pending[r] = [s for s in pending[r] if s not in known]
                if self.receiver(a) is not None:
                    pending[r].append(a)
                after[a] = list(clock[r])
        return tuple(tuple(o) for o in out)

    def markdown(self) -> str:
        """The table in Markdown: one row per step, one column per rank, the action (``"2F0"``) or ``-``."""
        head = "| step | " + " | ".join(f"rank {r}" for r in range(self.stages)) + " |"
        rule = "|---:|" + "---:|" * self.stages
        body = [f"| {t} | " + " | ".join("-" if a is None else str(a) for a in row) + " |"
                for t, row in enumerate(self.timed)]
        return "\n".join([head, rule, *body])

    def summary(self) -> str:
        """One line: name, S, M, R, steps, bubble fraction, peak in-flight microbatches per rank."""
        return (f"pipeline schedule {self.name}: S={self.stages} M={self.microbatches} R={self.repeats}, "
                f"{self.steps} steps of one action, bubble fraction {self.bubble_fraction():.3f}, peak in-flight "
                f"microbatches per rank {self.in_flight()}")


def build_schedule(name: str, stages: int, microbatches: int, repeats: int = 1) -> ScheduleTable:
    """The :class:`ScheduleTable` of schedule ``name`` (:data:`SCHEDULES`) for ``S`` x ``M`` x ``R``.

    Raises:
        ValueError: see :func:`check_schedule`.
    """
    check_schedule(name, stages, microbatches, repeats)
    S, M, R = stages, microbatches, repeats
    if name == "gpipe":
        order = [_gpipe(S, M, R, r) for r in range(S)]
    elif name == "1f1b":
        order = [_one_f_one_b(S, M, r) for r in range(S)]
    else:
        order = [_interleaved(S, M, R, r, zero_bubble=name == "zero-bubble") for r in range(S)]
    return ScheduleTable(name, S, M, R, tuple(tuple(o) for o in order))
