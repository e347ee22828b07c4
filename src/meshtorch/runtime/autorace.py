"""``--layout auto``'s decision between measured candidates: the rule (:func:`decide`: the default layout unless a
challenger is faster beyond the noise of the steps) and the sequential race that runs more interleaved steps
while that rule cannot yet tell (:func:`race`).

The race follows racing algorithms for configuration selection: F-race (Birattari, Stuetzle, Paquete and Varrentrapp,
"A Racing Algorithm for Configuring Metaheuristics", GECCO 2002) and successive halving as used by Hyperband
(Li, Jamieson, DeSalvo, Rostamizadeh and Talwalkar, JMLR 2018): every candidate still in contention takes one more
step per round, the rounds interleaved (and in alternating order, A B / B A, so a load that drifts up or down hits
both sides equally), candidates shown clearly worse drop out and get no more steps, and the race ends when the
decision is clear or the time budget is spent. In place of F-race's Friedman test it uses :func:`decide`'s own
margin (the larger of ``MIN_GAIN`` and the steps' relative interquartile range), so the race ends exactly when
the rule that chooses can decide.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, replace

MIN_GAIN = 0.05  # a candidate replaces the default only if its median is this much (or the steps' spread) faster
BUDGET_SHARE, BUDGET_STEPS = 0.2, 600  # measuring may cost 20% of a 600-step run of the default layout


def budget_s(default_step_s: float, share: float = BUDGET_SHARE) -> float:
    """Seconds ``--layout auto`` may spend measuring: ``share`` (default ``BUDGET_SHARE``) of ``BUDGET_STEPS``
    steps of the default layout (``default_step_s`` seconds each)."""
    return share * BUDGET_STEPS * default_step_s


def step_spread(times) -> float:
    """The spread of timed steps ``times`` (seconds) relative to their median: the interquartile range (the
    inclusive quartiles of :func:`statistics.quantiles`; with 3 steps half their min-max range) over the median;
    0 for fewer than 2 steps, inf when a step is not finite (a candidate that left the race)."""
    if not times or not all(math.isfinite(t) for t in times):
        return math.inf
    if len(times) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive")
    med = statistics.median(times)
    return (q3 - q1) / med if med > 0 else math.inf


def gain_margin(default_times, times) -> tuple[float, float, float, float]:
    """``(gain, margin, default's spread, the other's spread)`` of a candidate with timed steps ``times`` against
    the default's ``default_times`` (seconds): gain = 1 - the ratio of their medians (> 0: faster), margin = the
    larger of ``MIN_GAIN`` and either one's :func:`step_spread`."""
    md, mc = statistics.median(default_times), statistics.median(times)
    sd, sc = step_spread(default_times), step_spread(times)
    return (1 - mc / md if md > 0 else 0.0), max(MIN_GAIN, sd, sc), sd, sc


@dataclass
class Decision:
    """:func:`decide`'s answer: ``index`` (into the candidates) of the one to train with, ``challenger`` (the
    index of the least median other than the default; None when none), ``gain`` (relative: 1 - the challenger's
    median over the default's), ``margin`` (the gain it needed) and ``reason`` (one line, printed in the table)."""

    index: int
    challenger: int | None
    gain: float
    margin: float
    reason: str

    @property
    def undecided(self) -> bool:
        """The challenger's median is below the default's, but not by the margin: more steps could decide."""
        return self.challenger is not None and 0 < self.gain < self.margin


def decide(cands) -> Decision:
    """Which measured candidate to train with: the default layout, unless the challenger (the least median of
    the others' timed steps; ties to the cost model's order, ``cands``' order) is faster beyond the noise: its
    median at least ``margin`` below the default's, ``margin`` the larger of ``MIN_GAIN`` and the spread of either
    one's steps (:func:`step_spread`). Ties and gains within the noise keep the default. With no default among
    ``cands`` (it did not fit ``--memory-limit``) the least median wins. Under torchrun ``cands``' times are the
    slowest rank's (an all-reduce max), so every rank decides alike. ``cands``: objects with ``times`` (seconds),
    ``default`` and ``layout`` (:class:`meshtorch.runtime.autolayout.Candidate`)."""
    med = [statistics.median(c.times or (math.inf,)) for c in cands]
    d = next((i for i, c in enumerate(cands) if c.default), None)
    others = [i for i in range(len(cands)) if i != d]
    ch = min(others, key=lambda i: (med[i], i)) if others else None
    if d is None:
        return Decision(ch, ch, 0.0, 0.0, "no default layout measured: the least median")
    if ch is None:
        return Decision(d, None, 0.0, 0.0, "only the default layout measured")
    name = cands[ch].layout or "(replicated)"
    if not math.isfinite(med[ch]):
        return Decision(d, ch, 0.0, math.inf, "default kept: no other candidate finished its steps")
    if not math.isfinite(med[d]):
        return Decision(ch, ch, 1.0, 0.0, f"default replaced: {name}; the default did not finish its steps")
    gain, margin, sd, sc = gain_margin(cands[d].times, cands[ch].times)
    steps = f"{len(cands[d].times)} vs {len(cands[ch].times)} timed steps"
    why = (f"{name} {100 * gain:.1f}% faster (median, {steps}) than the default layout, "
           f"{'beyond' if gain >= margin else 'within'} the margin {100 * margin:.1f}% (the larger of "
           f"{100 * MIN_GAIN:.0f}% and the steps' spread, interquartile range / median: the default's "
           f"{100 * sd:.1f}%, {name}'s {100 * sc:.1f}%)")
    if gain >= margin:
        return Decision(ch, ch, gain, margin, f"default replaced: {why}")
    if gain <= 0:
        why = (f"{name}, the fastest other, is not faster (median {med[ch] * 1e3:.1f} vs the default's "
               f"{med[d] * 1e3:.1f} ms, {steps})")
    return Decision(d, ch, gain, margin, f"default kept: {why}")


def in_contention(cands, dropped: set) -> list[int]:
    """Indices of the candidates that race on: the default and every other candidate with finite steps, not in
    ``dropped``, whose gain over the default is inside the margin (``-margin < gain < margin``,
    :func:`gain_margin`); an empty list when the decision is clear: the challenger (:func:`decide` over the
    candidates not dropped) is faster beyond the margin, or no other candidate is inside it. Candidates clearly
    slower (gain <= -margin) are added to ``dropped`` (indices) first, for good: they get no more steps and
    cannot be chosen."""
    d = next((i for i, c in enumerate(cands) if c.default), None)
    if d is None:
        return []
    finite = [i for i, c in enumerate(cands) if c.times and all(math.isfinite(t) for t in c.times)]
    gm = {i: gain_margin(cands[d].times, cands[i].times)[:2] for i in finite if i != d and i not in dropped}
    dropped.update(i for i, (gain, margin) in gm.items() if gain <= -margin)
    live = [i for i in range(len(cands)) if i not in dropped]
    if live[decide([cands[i] for i in live]).index] != d:
        return []
    out = [i for i, (gain, margin) in gm.items() if i not in dropped and gain < margin]
    return [d] + out if out else []


@dataclass
class Race:
    """What :func:`race` did: ``rounds`` (extra interleaved rounds run), ``stop`` (decided: ``"replaced"`` or
    ``"kept"``; ``"budget"``: spent while undecided; ``"none"``: no race), ``budget_s`` (seconds allowed),
    ``spent_s`` (seconds spent measuring, the slowest rank's), ``dropped`` (index into the raced candidates ->
    its timed steps when it dropped out)."""

    rounds: int = 0
    stop: str = "kept"
    budget_s: float = math.inf
    spent_s: float = 0.0
    dropped: dict | None = None

    def line(self, share: float = BUDGET_SHARE) -> str:
        """One line for the table: how long the race ran and why it stopped."""
        if self.stop == "none":
            return ("race: none (under --memory-limit one candidate is held at a time; or no default layout "
                    "measured)")
        how = (f"race: {self.rounds} more interleaved round{'s' if self.rounds != 1 else ''} after the first steps, "
               f"{self.spent_s:.1f} s measured of the {self.budget_s:.1f} s budget ({100 * share:.0f}% of "
               f"{BUDGET_STEPS} default steps); ")
        if self.stop == "budget":
            return how + ("stopped: the next round would exceed the budget, still undecided, so the rule decides "
                          "on the steps so far")
        if self.stop == "replaced":
            return how + "stopped: decided, the challenger is faster than the default beyond the margin"
        return how + "stopped: decided, no other candidate is inside the margin (the slower beyond it dropped out)"


def race(held, spent: float, share: float = BUDGET_SHARE, agree=lambda v: v) -> Race:
    """Race the ``held`` candidates (``[(candidate, step)]``, ``step()`` runs one timed step and returns its
    seconds; each candidate already has its first timed steps in ``times``) until the decision is clear or the
    budget is spent. The budget (:func:`budget_s` with ``share``) is set before each round from the default's
    median timed step so far; ``spent`` is the seconds already spent choosing (ranking, builds, warm-ups and
    steps), and each raced step adds its wall time (at least the seconds it returns). Before each round, on the
    slowest rank's steps (``agree``: an all-reduce max over the ranks of a list of floats; identity in one
    process) the candidates in contention are found (:func:`in_contention`, the clearly slower dropped for good);
    the race stops when none is (decided) or when the seconds spent plus the round's predicted cost (the sum of
    their medians) would exceed the budget; else each takes one more timed step, in the order of ``held`` on even
    rounds and reversed on odd ones. Appends to each candidate's ``times`` (this rank's seconds); returns what
    happened (:class:`Race`)."""
    cands = [c for c, _ in held]
    if not any(c.default for c in cands):
        return Race(stop="none", spent_s=spent, dropped={})
    dropped, log = set(), Race(dropped={})
    while True:
        flat = agree([t for c in cands for t in c.times] + [spent])
        seen, at = [], 0  # the slowest rank's steps: every rank decides alike
        for c in cands:
            seen.append(replace(c, times=tuple(flat[at:at + len(c.times)])))
            at += len(c.times)
        log.spent_s = flat[-1]  # the budget from the default's median so far: the surest estimate of its step
        log.budget_s = budget_s(statistics.median(next(c for c in seen if c.default).times), share)
        before = set(dropped)
        racing = in_contention(seen, dropped)
        for i in dropped - before:
            log.dropped[i] = len(seen[i].times)
        if not racing:
            live = [c for i, c in enumerate(seen) if i not in dropped]
            log.stop = "kept" if live[decide(live).index].default else "replaced"
            return log
        cost = sum(statistics.median(seen[i].times) for i in racing)
        if log.spent_s + cost > log.budget_s:
            log.stop = "budget"
            return log
        for i in racing if log.rounds % 2 == 0 else racing[::-1]:
            t0 = time.perf_counter()
            t = held[i][1]()
            cands[i].times += (t,)
            spent += max(t, time.perf_counter() - t0)  # the step's wall time, its untimed feeding included
        log.rounds += 1
