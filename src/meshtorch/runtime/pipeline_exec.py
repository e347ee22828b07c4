"""The pipeline stage executor: per-virtual-stage programs (:func:`meshtorch.models.lm_stages.stage_programs`)
run in a schedule table's order (issue 32).

:func:`run_schedule` walks :attr:`~meshtorch.core.schedules.ScheduleTable.timed` step by step in one process
(every rank's actions, the transfers between ranks handed over in memory); :func:`run_rank` runs one rank per
process of a ``torch.distributed`` group (gloo), each walking its own row of actions and exchanging activations
and gradients with ``isend``/``recv`` (as ``torch.distributed.pipelining``'s ``_PipelineSchedule`` does). Per
action only that stage's program runs on that microbatch: idle steps run nothing, the embeddings run only on
stage 0 and the loss only on the last. Every transfer to another rank is recorded by the flight recorder
(:mod:`meshtorch.mesh.recorder`) as one ``"send"`` record over the stage axis, so ``lowering.counters``-style
reports and tests count them as they count collectives. :func:`apply_updates` then runs each stage's
optimizer on the gradients summed over the microbatches (the training step of ``meshtorch train
--pipeline-schedule``, :mod:`meshtorch.runtime.pipeline_train`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from meshtorch.core.schedules import ScheduleTable
from meshtorch.mesh.recorder import flight_recorder
from meshtorch.planning import memory_report

__all__ = ["SEND", "ScheduleRun", "action_fetches", "action_flops", "apply_updates", "clip_coefficient", "rank_flops",
           "rank_memory", "run_forward", "run_rank", "run_schedule"]

#: the flight recorder's kind of a point-to-point transfer between pipeline ranks
SEND = "send"


@dataclass
class ScheduleRun:
    """What :func:`run_schedule` / :func:`run_rank` return: ``loss`` (mean over the microbatches; :func:`run_rank`:
    None except on the last stage's rank), ``grads`` (by variable name, of that mean; :func:`run_rank`: this
    rank's variables), ``actions`` per rank in the order run, ``peak_stash`` per rank (the most stage inputs it
    held at once), ``wait_s`` (:func:`run_rank`: seconds waiting for receives and the last sends), ``events`` per
    rank: its timeline, ``(name, category, start_ns, end_ns)`` in ``time.perf_counter_ns`` nanoseconds, one
    ``"action"`` per action run (named as torch's ``"1F3"``) and, inside them, :func:`run_rank`'s ``"recv"`` (blocked
    in ``recv``), ``"send"`` (posting the ``isend``) and ``"wait"`` (blocked waiting for sends), and the step's last
    ``"wait"`` (:mod:`meshtorch.runtime.pipeline_trace` reads them)."""

    loss: float | None
    grads: dict
    actions: list = field(default_factory=list)
    peak_stash: list = field(default_factory=list)
    wait_s: float = 0.0
    events: list = field(default_factory=list)


class _Executor:
    """Runs actions; transfers between ranks are dict entries here (:class:`_DistExecutor`: gloo messages)."""

    def __init__(self, table: ScheduleTable, programs: list, ids: torch.Tensor, targets: torch.Tensor,
                 axis: str = "pipe"):
        S, M, V = table.stages, table.microbatches, table.virtual_stages
        if len(programs) != V:
            raise ValueError(f"run_schedule: {len(programs)} stage programs for {V} virtual stages.")
        self.table, self.programs, self.M, self.V, self.axis = table, programs, M, V, axis
        self.ids, self.targets = ids.chunk(M), targets.chunk(M)
        self.acts: dict = {}  # (v, m) -> input of stage v for microbatch m
        self.grads_in: dict = {}  # (v, m) -> gradient of stage v's output for microbatch m
        self.saved: dict = {}  # (v, m) -> the laid-out activations stage v's forward stashed for its gradients
        self.stash: list[set] = [set() for _ in range(S)]
        self.run = ScheduleRun(0.0, {}, [[] for _ in range(S)], [0] * S, events=[[] for _ in range(S)])

    def record(self, value: torch.Tensor, src: int) -> None:
        rec = flight_recorder().record(SEND, (self.axis,), (value.numel() * value.element_size(),), value.dtype,
                                       "", self.table.stages, src)
        if rec is not None:
            rec.finish()

    def send(self, store: dict, key, value, src: int, dst: int, tag: int) -> None:
        store[key] = value
        if src != dst:
            self.record(value, src)

    def receive(self, store: dict, key, src: int, dst: int, tag: int, like) -> torch.Tensor:
        if key not in store:
            raise RuntimeError(f"pipeline executor: virtual stage {key[0]} on rank {dst} needs microbatch {key[1]}'s "
                               f"{'activation' if store is self.acts else 'output gradient'} from rank {src}, which "
                               "was never sent (the schedule table runs an action before what it needs).")
        return store[key]

    def execute(self, a, r: int) -> None:
        """Rank ``r`` runs action ``a``: its stage program's forward, input-gradient and/or weight-gradient
        fetches on microbatch ``a.microbatch``; its start and end go to rank ``r``'s ``events``."""
        t0 = time.perf_counter_ns()
        self._compute(a, r)
        self.run.events[r].append((str(a), "action", t0, time.perf_counter_ns()))

    def _compute(self, a, r: int) -> None:
        p, v, m, M, V, t = self.programs[a.stage], a.stage, a.microbatch, self.M, self.V, self.table
        tag = 2 * (v * M + m)  # even: the activation entering stage v; odd: the gradient leaving stage v's output
        x = self.ids[m] if v == 0 else self.receive(self.acts, (v, m), t.rank_of(v - 1), r, tag, p.inputs)
        feeds = {p.inputs: x}
        if p.targets is not None:
            feeds[p.targets] = self.targets[m]
        if p.output_grad is not None and a.kind != "F":
            feeds[p.output_grad] = self.receive(self.grads_in, (v, m), t.rank_of(v + 1), r,
                                                2 * ((v + 1) * M + m) + 1, p.output_grad)
        self.run.actions[r].append(a)
        if a.kind == "F":
            (y,), self.saved[(v, m)] = p.lowering.run_stashed([p.output], feeds, stash=p.saved)
            self.acts[(v, m)] = x  # the stash, until the backward is done
            self.stash[r].add((v, m))
            self.run.peak_stash[r] = max(self.run.peak_stash[r], len(self.stash[r]))
            if v == V - 1:
                self.run.loss += float(y) / M
            else:
                self.send(self.acts, (v + 1, m), y, r, t.rank_of(v + 1), 2 * ((v + 1) * M + m))
            return
        fetch_in, names = _gradient_fetches(p, a.kind)
        saved = self.saved[(v, m)]
        out, more = p.lowering.run_stashed(action_fetches(p, a.kind), feeds, given=saved,
                                           stash=p.saved_grads if a.kind == "I" else ())
        saved.update(more)  # an I's activation gradients, for its W
        if fetch_in:
            self.send(self.grads_in, (v - 1, m), out[0], r, t.rank_of(v - 1), tag + 1)
            out = out[1:]
        for n, g in zip(names, out, strict=True):  # summed in place (the first microbatch's copied)
            if n in self.run.grads:
                self.run.grads[n].add_(g)
            else:
                self.run.grads[n] = g.clone()
        if names:  # the stage's input and output gradient are no longer needed
            self.stash[r].discard((v, m))
            self.acts.pop((v, m), None)
            self.saved.pop((v, m), None)
            self.grads_in.pop((v, m), None)

    def result(self) -> ScheduleRun:
        self.run.grads = {n: g.div_(self.M) for n, g in self.run.grads.items()}
        return self.run


def _gradient_fetches(p, kind: str) -> tuple[bool, list]:
    """``(whether the input gradient is fetched, the weights whose gradients are)`` of a ``B``/``I``/``W``."""
    return kind in ("B", "I") and p.input_grad is not None, list(p.weight_grads) if kind in ("B", "W") else []


def action_fetches(p, kind: str) -> list:
    """What an action of ``kind`` (``F``, ``B``, ``I``, ``W``) fetches of stage program ``p``: the output (``F``),
    the input gradient (``B``, ``I``; none on stage 0) and the weight gradients (``B``, ``W``)."""
    if kind == "F":
        return [p.output]
    fetch_in, names = _gradient_fetches(p, kind)
    return ([p.input_grad] if fetch_in else []) + [p.weight_grads[n] for n in names]


def action_flops(programs: list):
    """``cost(action)``: the planned einsum FLOPs of one action's program (global over the mesh inside a stage;
    :meth:`~meshtorch.Lowering.plan_counters`, nothing run; a gradient action is given its forward's stashed
    activations, so it counts no forward einsum, and a ``W`` its ``I``'s activation gradients), memoized per
    (virtual stage, kind). ``programs``: every virtual stage's
    (:func:`~meshtorch.models.lm_stages.stage_programs` without ``rank``)."""
    cost: dict = {}

    def flops(a) -> int:
        key = (a.stage, a.kind)
        if key not in cost:
            f = action_fetches(programs[a.stage], a.kind)
            p = programs[a.stage]
            given = {"F": (), "W": p.saved + p.saved_grads}.get(a.kind, p.saved)
            cost[key] = p.lowering.plan_counters(f, given=given).einsum_flops if f else 0
        return cost[key]

    return flops


def rank_flops(table: ScheduleTable, programs: list) -> list[int]:
    """Planned einsum FLOPs per rank of one step of ``table``: the sum of :func:`action_flops` over the rank's
    actions (idle steps cost nothing)."""
    flops = action_flops(programs)
    return [sum(flops(a) for a in row) for row in table.order]


def _nbytes(t) -> int:
    """Bytes of graph tensor ``t`` (full shape: one processor per stage mesh in the executor's runs)."""
    return math.prod(d.size for d in t.shape) * t.dtype.itemsize


def _action_memory(p, kind: str) -> tuple[int, int, int]:
    """``(transient, fetched, held_feeds)`` of an action of ``kind`` on stage program ``p``: the peak of live
    values of its :meth:`~meshtorch.Lowering.run_stashed` run as the executor calls it (given the forward's stash,
    keeping the slots it stashes; :func:`meshtorch.planning.memory_report`), the bytes it fetches, and the bytes
    of its feeds the executor already holds (a gradient action's stage input, a ``W``'s output gradient), which
    that peak counts again."""
    lw = p.lowering
    given = {"F": (), "W": p.saved + p.saved_grads}.get(kind, p.saved)
    stash = {"F": p.saved, "I": p.saved_grads}.get(kind, ())
    fetches = action_fetches(p, kind)
    fed = {n for n, _ in lw.plan(fetches, given, stash).placeholders}
    held = [p.inputs] if kind != "F" else []
    held += [p.output_grad] if kind == "W" and p.output_grad is not None else []
    return (memory_report(lw, fetches, given, stash).peak_activation_bytes, sum(_nbytes(t) for t in fetches),
            sum(_nbytes(t) for t in held if t.name in fed))


def rank_memory(table: ScheduleTable, programs: list) -> list[dict]:
    """Planned bytes per processor of each rank for one training step of ``table`` (dry run: the stage programs'
    plans, :func:`meshtorch.planning.memory_report`), by walking the rank's actions in order as
    :func:`run_rank` and :func:`apply_updates` hold tensors: ``variables`` (weights, optimizer slots, step counters
    of its stages); ``gradients`` (the weight gradients summed over the microbatches, from the stage's first
    gradient action on); per microbatch in flight its ``stash`` (the stage input, the activations its forward
    stashes, zero-bubble also the activation gradients its ``I`` stashes and the output gradient it keeps for its
    ``W``; the most of the rank's stages), held from its ``F`` to its last gradient action; the sends: every
    activation and input gradient sent to another rank (its ``isend`` buffer), from its action until the action
    whose receive proves it received (:attr:`~meshtorch.core.schedules.ScheduleTable.send_waits`, where
    :func:`run_rank` waits for and frees it; the others until the step's end); and the running action's
    ``transient`` (its run's peak of live values, its received output gradient, and at a
    stage's first gradient action the copy its fetched weight gradients are summed into); after the step, the
    optimizer's run. ``total`` is the largest sum over that walk, reached at ``peak_at`` (``"F3 on stage 0"``,
    ``"optimizer"``); ``in_flight`` is the table's peak of microbatches in flight, ``sends`` the bytes sent in the
    step, ``sends_held`` the bytes of sends held at the peak, ``transient`` the largest action transient.
    ``programs``: every virtual stage's (:func:`~meshtorch.models.lm_stages.stage_programs`)."""
    zb = table.name == "zero-bubble"
    out = []
    for r, peak in enumerate(table.in_flight()):
        row = dict(variables=0, gradients=0, stash=0, transient=0, sends=0, sends_held=0, in_flight=peak, total=0,
                   peak_at="")
        mine = programs[r::table.stages]
        grads = {p.stage: sum(_nbytes(t) for t in p.weight_grads.values()) for p in mine}
        costs = {(p.stage, k): _action_memory(p, k) for p in mine for k in {a.kind for a in table.order[r]}}
        for p in mine:
            sizes = p.lowering.program.slot_bytes
            kept = sum(sizes.get(s, 0) for s in p.saved) + _nbytes(p.inputs)
            grad_kept = sum(sizes.get(s, 0) for s in p.saved_grads) + (_nbytes(p.output_grad) if p.output_grad
                                                                       is not None else 0)
            row["stash"] = max(row["stash"], kept + (grad_kept if zb else 0))
            row["variables"] += memory_report(p.lowering, list(p.updates) or [p.output]).variable_bytes
        row["gradients"] = sum(grads.values())

        held, summed, sent = {}, set(), {}  # (stage, microbatch) -> bytes; stages with gradient sums; sends held

        def bump(now: int, where: str) -> None:
            if now > row["total"]:
                row["total"], row["peak_at"], row["sends_held"] = now, where, sum(sent.values())

        for a, waits in zip(table.order[r], table.send_waits[r], strict=True):
            p, v = programs[a.stage], a.stage
            transient, fetched, double = costs[(v, a.kind)]
            received = _nbytes(p.output_grad) if a.kind in ("B", "I") and p.output_grad is not None else 0
            row["transient"] = max(row["transient"], transient - double)
            for s in waits:  # freed after the action's receive, before its compute
                sent.pop(s)
            base = row["variables"] + sum(grads[s] for s in summed) + sum(held.values()) + sum(sent.values())
            where = f"{a.kind}{a.microbatch} on stage {v}"
            bump(base + transient - double, where)
            weights = a.kind in ("B", "W")
            if weights and v not in summed:  # the fetched gradients and their first copies
                bump(base + received + fetched + grads[v], where)
                summed.add(v)
            sizes = p.lowering.program.slot_bytes
            if a.kind == "F":
                held[(v, a.microbatch)] = _nbytes(p.inputs) + sum(sizes.get(s, 0) for s in p.saved)
            if table.receiver(a) is not None:
                sent[a] = _nbytes(p.output if a.kind == "F" else p.input_grad)
                row["sends"] += sent[a]
            if a.kind == "I":
                held[(v, a.microbatch)] += received + sum(sizes.get(s, 0) for s in p.saved_grads)
            if weights:
                held.pop((v, a.microbatch), None)
        sent.clear()  # run_rank's last wait
        for p in mine:  # apply_updates: its gradient feeds are the sums counted above
            if p.updates:
                feeds = sum(_nbytes(t) for t in p.grad_feeds.values())
                bump(row["variables"] + row["gradients"]
                     + memory_report(p.lowering, list(p.updates)).peak_activation_bytes - feeds, "optimizer")
        out.append(row)
    return out


class _DistExecutor(_Executor):
    """One rank of a ``torch.distributed`` group (gloo): transfers to other ranks are ``isend`` / ``recv`` with
    the tag of (stage, microbatch, direction), so messages match whatever order the ranks post them in. A send's
    buffer is waited for and freed as soon as a receive proves it was received
    (:attr:`~meshtorch.core.schedules.ScheduleTable.send_waits`: right after the receiving action's ``recv``,
    before its compute), the others at the step's end; gloo completes a send only once the receiver has posted
    its ``recv``, so an earlier ``wait`` could block on a rank that waits for this one."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        r = dist.get_rank()
        self.waits = dict(zip(self.table.order[r], self.table.send_waits[r], strict=True))
        self.pending: dict = {}  # sending action -> (isend work, its buffer)
        self.now = None  # the running action

    def execute(self, a, r):
        self.now = a
        super().execute(a, r)

    def send(self, store, key, value, src, dst, tag):
        if src == dst:
            store[key] = value
            return
        t0 = time.perf_counter_ns()
        value = value.contiguous()
        self.record(value, src)
        self.pending[self.now] = (dist.isend(value, dst, tag=tag), value)
        self.run.events[src].append((f"send to rank {dst}", "send", t0, time.perf_counter_ns()))

    def receive(self, store, key, src, dst, tag, like):
        if key in store or src == dst:
            return super().receive(store, key, src, dst, tag, like)
        buf = torch.empty([d.size for d in like.shape], dtype=like.dtype)
        t0 = time.perf_counter_ns()
        dist.recv(buf, src, tag=tag)
        t1 = time.perf_counter_ns()
        self.run.events[dst].append((f"recv from rank {src}", "recv", t0, t1))
        self._wait([self.pending.pop(s) for s in self.waits[self.now]], dst)
        self.run.wait_s += (time.perf_counter_ns() - t0) / 1e9
        store[key] = buf
        return buf

    def _wait(self, sends: list, r: int) -> None:
        if not sends:
            return
        t0 = time.perf_counter_ns()
        for work, _ in sends:
            work.wait()
        t1 = time.perf_counter_ns()
        self.run.events[r].append((f"wait {len(sends)} send(s)", "wait", t0, t1))

    def result(self):
        t0 = time.perf_counter_ns()
        self._wait(list(self.pending.values()), dist.get_rank())
        self.pending.clear()
        self.run.wait_s += (time.perf_counter_ns() - t0) / 1e9
        return super().result()


def run_schedule(table: ScheduleTable, programs: list, ids: torch.Tensor, targets: torch.Tensor,
                 axis: str = "pipe") -> ScheduleRun:
    """Run one step's forward and backward passes of every rank in ``table``'s order, in this process: step by
    step through :attr:`~meshtorch.core.schedules.ScheduleTable.timed`, nothing on idle steps.

    Args:
        table: the schedule (its ``S R`` must be ``len(programs)``).
        programs: :func:`~meshtorch.models.lm_stages.stage_programs` (same ``M``).
        ids, targets: int64 ``[batch, length]``; microbatch ``m`` is rows ``m B/M .. (m+1) B/M - 1``.
        axis: the mesh axis the flight recorder names for the transfers between ranks.

    Returns:
        :class:`ScheduleRun`; the gradients are accumulated over microbatches and divided by ``M``.

    Raises:
        ValueError: ``len(programs)`` is not the table's virtual stages.
        RuntimeError: an action needs a transfer that was never made (a table out of dependency order).
    """
    ex = _Executor(table, programs, ids, targets, axis)
    for row in table.timed:
        for r, a in enumerate(row):
            if a is not None:
                ex.execute(a, r)
    return ex.result()


def run_rank(table: ScheduleTable, programs: list, ids: torch.Tensor, targets: torch.Tensor,
             axis: str = "pipe") -> ScheduleRun:
    """This process's rank (``torch.distributed.get_rank()``, a group of ``table.stages`` processes, gloo) runs
    its actions ``table.order[rank]`` in order, receiving activations and gradients from the neighbouring ranks
    when it needs them (``programs``: :func:`~meshtorch.models.lm_stages.stage_programs` with ``rank``;
    ``ids``/``targets`` the full batch, read on the first and last stage only). Returns its :class:`ScheduleRun`
    (loss on the last stage's rank).

    Raises:
        ValueError: the group's size is not the table's stages.
    """
    r = dist.get_rank()
    if dist.get_world_size() != table.stages:
        raise ValueError(f"run_rank: {dist.get_world_size()} processes for {table.stages} pipeline ranks.")
    ex = _DistExecutor(table, programs, ids, targets, axis=axis)
    for a in table.order[r]:
        ex.execute(a, r)
    out = ex.result()
    if table.rank_of(table.virtual_stages - 1) != r:
        out.loss = None
    return out


def clip_coefficient(sum_of_squares: float, clip_norm: float, eps: float = 1e-6) -> float:
    """``min(1, clip_norm / (sqrt(sum_of_squares) + eps))``: the factor
    :func:`meshtorch.optim.clip_by_global_norm` (and ``torch.nn.utils.clip_grad_norm_``) scales every gradient
    by, from the squared global norm summed over the pipeline's stages."""
    return min(1.0, clip_norm / (math.sqrt(sum_of_squares) + eps))


def apply_updates(programs: list, grads: dict, clip_norm: float | None = None, distributed: bool = False) -> float:
    """Run the optimizer of every stage this process holds (``programs`` entries not None, built with
    ``stage_programs(optimizer=...)``) on ``grads`` (by variable name, float32 full tensors: the step's
    gradients, as :class:`ScheduleRun` has them). With ``clip_norm`` the gradients are scaled first by
    :func:`clip_coefficient` of their global norm (summed over the group's ranks with ``distributed``: one
    all-reduce of a float64 scalar). Returns the global norm before clipping (NaN when not clipped)."""
    norm = float("nan")
    coef = None
    if clip_norm:
        sq = torch.tensor(sum(float(g.double().square().sum()) for g in grads.values()), dtype=torch.float64)
        if distributed:
            dist.all_reduce(sq)
        norm, coef = math.sqrt(float(sq)), clip_coefficient(float(sq), clip_norm)
    for p in programs:
        if p is None:
            continue
        feeds = {p.grad_feeds[n]: grads[n] for n in p.grad_feeds}
        if p.clip_coefficient is not None:
            feeds[p.clip_coefficient] = torch.tensor(1.0 if coef is None else coef)
        p.lowering.run(p.updates, feeds)
    return norm


def run_forward(table: ScheduleTable, programs: list, ids: torch.Tensor, targets: torch.Tensor,
                distributed: bool = False) -> float | None:
    """The mean loss over the ``M`` microbatches of ``ids``/``targets`` (int64 ``[batch, length]``), forward
    passes only (evaluation): microbatch by microbatch, each virtual stage this process holds runs its forward
    program (nothing stashed) and hands its output to the next stage (``distributed``: this process is rank
    ``torch.distributed.get_rank()`` and receives / ``isend``-s the activations from / to the neighbouring ranks,
    as :func:`run_rank`). Returns the loss on the process holding the last stage, None on the others."""
    M, V = table.microbatches, table.virtual_stages
    me = dist.get_rank() if distributed else None
    ids, targets = ids.chunk(M), targets.chunk(M)
    loss, pending = 0.0, []
    for m in range(M):
        x = ids[m]
        for v in range(V):
            p, r = programs[v], table.rank_of(v)
            if distributed and r != me:
                continue
            if distributed and v and table.rank_of(v - 1) != me:
                x = torch.empty([d.size for d in p.inputs.shape], dtype=p.inputs.dtype)
                dist.recv(x, table.rank_of(v - 1), tag=2 * (v * M + m))
            feeds = {p.inputs: x}
            if p.targets is not None:
                feeds[p.targets] = targets[m]
            x = p.lowering.run(p.output, feeds=feeds)
            if v == V - 1:
                loss += float(x) / M
            elif distributed and table.rank_of(v + 1) != me:
                x = x.contiguous()
                pending.append((dist.isend(x, table.rank_of(v + 1), tag=2 * ((v + 1) * M + m)), x))
    for work, _ in pending:
        work.wait()
    return loss if not distributed or table.rank_of(V - 1) == me else None
