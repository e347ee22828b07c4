"""The pipeline stage executor's timeline (issue 32): a Chrome / Perfetto trace of every rank's actions and the
bubble fraction measured from it.

:mod:`meshtorch.runtime.pipeline_exec` records, per rank, each action's start and end
(``time.perf_counter_ns``; :attr:`~meshtorch.runtime.pipeline_exec.ScheduleRun.events`) and, inside the actions,
the time blocked in ``recv`` and in waiting for sends. Here those timelines, one per training step and rank on a
common clock (nanoseconds since an origin taken right after a barrier), become

* :func:`chrome_trace`: the Trace Event Format JSON that ``torch.profiler``'s ``export_chrome_trace`` writes
  (``{"traceEvents": [...]}`` of complete ``"X"`` events, microseconds): one process track per pipeline rank,
  per step a ``"step N"`` slice holding one slice per action (torch's notation, ``"1F3"`` = virtual stage 1's
  forward of microbatch 3; ``B`` backward, ``I`` input gradient, ``W`` weight gradient) and, nested in them,
  ``recv from rank r`` / ``send to rank r`` / ``wait N send(s)``. ``meshtorch train --pipeline-trace FILE``
  writes it; open it in https://ui.perfetto.dev or chrome://tracing.
* :func:`step_bubbles`: per rank, the idle share of one step: ``1 - busy / window``, the window running from the
  first rank's first action to the last rank's last event, busy the rank's action time less the time it was
  blocked in receives and send waits inside them. Its mean over the ranks is what the table's idle slots
  predict (:meth:`~meshtorch.core.schedules.ScheduleTable.bubble_fraction`: ``(S-1)/(M+S-1)`` for GPipe and
  1F1B, ``(S-1)/(R M+S-1)`` interleaved).
* :func:`action_times`, :func:`action_costs` and :func:`predicted_bubble`: the same table timed by the measured
  compute time of each action of a step, or the median of each (virtual stage, kind)
  (:meth:`~meshtorch.core.schedules.ScheduleTable.weighted`), the reference that holds whatever the backward /
  forward cost ratio, the stages' imbalance and the actions' jitter (the closed formulas assume equal stages and
  constant costs).
"""

from __future__ import annotations

import json
import statistics

from meshtorch.core.schedules import ScheduleTable

__all__ = ["BLOCKED", "action_costs", "action_times", "chrome_trace", "predicted_bubble", "rank_costs", "step_bubbles",
           "write_chrome_trace"]

#: the event categories that are time a rank spends blocked (not computing)
BLOCKED = ("recv", "wait")


def rank_costs(events: list) -> list[tuple[str, int, int, int]]:
    """``(name, start_ns, end_ns, blocked_ns)`` of each action of one rank's step ``events`` (the
    :attr:`~meshtorch.runtime.pipeline_exec.ScheduleRun.events` of a rank), in order: ``blocked_ns`` is the time
    in the ``recv`` and ``wait`` events recorded while it ran (they are listed before it)."""
    out, blocked = [], 0
    for name, cat, t0, t1 in events:
        if cat in BLOCKED:
            blocked += t1 - t0
        elif cat == "action":
            out.append((name, t0, t1, blocked))
            blocked = 0
    return out


def step_bubbles(ranks: list) -> list[dict]:
    """Per rank of one step (``ranks[r]``: rank ``r``'s events on the common clock, every rank's): ``bubble`` =
    idle / window and ``blocked`` = blocked in receives and send waits / window, where window (``window_ns``) is
    the first rank's first event to the last rank's last event and idle = window - busy (``busy_ns``: its actions'
    time less the blocked time inside them), so the time before a rank's first action and after its last
    counts as idle, as the table's empty slots do. Empty when no rank recorded an event."""
    spans = [(e[2], e[3]) for evs in ranks for e in evs]
    if not spans:
        return []
    window = max(t1 for _, t1 in spans) - min(t0 for t0, _ in spans)
    out = []
    for evs in ranks:
        acts = rank_costs(evs)
        busy = sum(t1 - t0 - b for _, t0, t1, b in acts)
        blocked = sum(t1 - t0 for _, cat, t0, t1 in evs if cat in BLOCKED)
        out.append({"bubble": 1 - busy / window if window else 0.0, "blocked": blocked / window if window else 0.0,
                    "busy_ns": busy, "window_ns": window})
    return out


def action_times(table: ScheduleTable, ranks: list) -> dict:
    """``{action: compute seconds}`` of one step (``ranks[r]``: rank ``r``'s events), compute = the action's time
    less its blocked time.

    Raises:
        ValueError: a rank's actions are not its row of ``table`` (``table.order[r]``), named."""
    out = {}
    for r, evs in enumerate(ranks):
        acts = rank_costs(evs)
        if [n for n, *_ in acts] != [str(a) for a in table.order[r]]:
            raise ValueError(f"pipeline trace: rank {r} ran {[n for n, *_ in acts]}, not its row of the "
                             f"{table.name} table {[str(a) for a in table.order[r]]}.")
        for a, (_, t0, t1, b) in zip(table.order[r], acts, strict=True):
            out[a] = (t1 - t0 - b) / 1e9
    return out


def action_costs(table: ScheduleTable, steps: list) -> dict:
    """``{(virtual stage, kind): median compute seconds}`` over the actions of ``steps`` (each a list of every
    rank's events of one step; :func:`action_times`, which raises ValueError for a rank out of its row)."""
    seen: dict = {}
    for ranks in steps:
        for a, sec in action_times(table, ranks).items():
            seen.setdefault((a.stage, a.kind), []).append(sec)
    return {k: statistics.median(v) for k, v in seen.items()}


def predicted_bubble(table: ScheduleTable, costs: dict) -> float:
    """The bubble fraction of ``table`` with each action taking ``costs[action]`` seconds (:func:`action_times`:
    one step's own durations) or else ``costs[(virtual stage, kind)]`` (:func:`action_costs`)
    (:meth:`~meshtorch.core.schedules.ScheduleTable.weighted`, transfers taking no time)."""
    return table.weighted(lambda a: costs[a] if a in costs else costs[(a.stage, a.kind)])[1]


def chrome_trace(steps: list, name: str = "") -> dict:
    """The Trace Event Format object (``torch.profiler``'s ``export_chrome_trace`` format) of ``steps`` (each a list
    of every rank's events of one step, nanoseconds on a common clock): process ``r`` = pipeline rank ``r``; per
    step and rank a ``"step k"`` slice (``args``: that rank's measured ``bubble`` and ``blocked`` shares,
    :func:`step_bubbles`) holding the rank's action slices and their nested ``recv`` / ``send`` / ``wait``
    slices. ``name``: the schedule, in the process names."""
    S = max((len(r) for r in steps), default=0)
    out = []
    for r in range(S):
        out.append({"name": "process_name", "ph": "M", "pid": r, "tid": 0,
                    "args": {"name": f"pipeline rank {r}" + (f" ({name})" if name else "")}})
        out.append({"name": "process_sort_index", "ph": "M", "pid": r, "tid": 0, "args": {"sort_index": r}})
    for k, ranks in enumerate(steps):
        bubbles = step_bubbles(ranks)
        for r, evs in enumerate(ranks):
            if not evs:
                continue
            t0, t1 = min(e[2] for e in evs), max(e[3] for e in evs)
            out.append({"name": f"step {k}", "ph": "X", "cat": "step", "pid": r, "tid": 0, "ts": t0 / 1e3,
                        "dur": (t1 - t0) / 1e3, "args": {"bubble": round(bubbles[r]["bubble"], 4),
                                                         "blocked": round(bubbles[r]["blocked"], 4)}})
            for ev, cat, s, e in evs:
                out.append({"name": ev, "ph": "X", "cat": cat, "pid": r, "tid": 0, "ts": s / 1e3,
                            "dur": (e - s) / 1e3})
    return {"schemaVersion": 1, "displayTimeUnit": "ms", "traceEvents": out}


def write_chrome_trace(path: str, steps: list, name: str = "") -> None:
    """Write :func:`chrome_trace` of ``steps`` to ``path`` as JSON."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(chrome_trace(steps, name), f, separators=(",", ":"))
