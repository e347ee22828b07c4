"""Executed versus planned collectives: the check that a mesh implementation ran what the plan says.

``lowering.plan_counters(fetches)`` is what the planner decided (from shapes and layout rules);
``lowering.counters`` is what the mesh implementation recorded executing (its flight recorder,
:mod:`meshtorch.mesh.recorder`). :func:`executed_vs_planned` runs a fetch set and lists every
difference, so a backend that runs an all-reduce where a reduce-scatter was planned (same numbers,
more bytes) fails a test instead of passing silently.
"""

from __future__ import annotations

from collections.abc import Callable

from meshtorch.lowering.counters import Counters


def executed_vs_planned(lowering, fetches, feeds: dict | Callable[[int], dict] | None = None,
                        runs: int = 1) -> tuple[list[str], list]:
    """Run ``fetches`` ``runs`` times from zeroed counters; compare ``runs`` x planned with executed.

    Args:
        lowering: a :class:`~meshtorch.lowering.Lowering` (its counters are reset first).
        fetches: as for ``Lowering.run``.
        feeds: the feeds, or ``feeds(run index) -> feeds``.
        runs: how many runs.

    Returns:
        ``(differences, results)``: :meth:`~meshtorch.lowering.counters.Counters.diff` lines (``[]``:
        executed exactly as planned) and each run's results.
    """
    lowering.counters.reset()
    planned = Counters()
    planned.add(lowering.plan_counters(fetches), runs)
    results = []
    for r in range(runs):
        results.append(lowering.run(fetches, feeds=feeds(r) if callable(feeds) else feeds))
    return planned.diff(lowering.counters), results


def assert_executed_as_planned(lowering, fetches, feeds=None, runs: int = 1) -> list:
    """:func:`executed_vs_planned`, raising AssertionError (listing the differences) unless they agree
    and at least one collective ran; returns the runs' results."""
    diff, results = executed_vs_planned(lowering, fetches, feeds, runs)
    if diff:
        raise AssertionError("executed collectives differ from the plan:\n  " + "\n  ".join(diff))
    if lowering.counters.count() == 0:
        raise AssertionError("no collectives were executed (is the flight recorder off?); nothing was compared")
    return results


__all__ = ["assert_executed_as_planned", "executed_vs_planned"]
