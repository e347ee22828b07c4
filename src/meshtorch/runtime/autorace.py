"""``--layout auto``'s decision between measured candidates: the rule (:func:`decide`: the default layout unless a
challenger is at least ``MIN_GAIN`` faster with statistical confidence, on paired steps) and the sequential race
that runs more interleaved rounds while that rule cannot yet tell (:func:`race`).

The race follows racing algorithms for configuration selection: F-race (Birattari, Stuetzle, Paquete and Varrentrapp,
"A Racing Algorithm for Configuring Metaheuristics", GECCO 2002) and successive halving as used by Hyperband
(Li, Jamieson, DeSalvo, Rostamizadeh and Talwalkar, JMLR 2018): every candidate still in contention takes one more
step per round, the rounds interleaved (and in alternating order, A B / B A, so a load that drifts up or down hits
both sides equally), candidates shown worse drop out and get no more steps, and the race ends when the decision is
clear or the time budget is spent. As F-race's blocked (per-round) test, each round is a block: the challenger's
step over the default's step of the same round is a paired ratio ``r_i`` under the same load, and the decision
uses the sign test's distribution-free confidence bounds on the median of the ``r_i`` (the binomial order-statistic
interval, e.g. Conover, "Practical Nonparametric Statistics", 3rd ed. 1999, section 3.2; Hollander and Wolfe,
"Nonparametric Statistical Methods", ch. 3), whose width shrinks with the number of rounds, unlike the spread of
single steps. With fewer than 5 pairs no bound at 95% exists (``0.5 ** 4 > 0.05``), so the race extends before
it can replace the default. Dropping out errs toward the default, the safe side, and so uses a lower confidence
(``DROP_CONFIDENCE``, 87.5%: a candidate not 5% faster in any of the first 3 rounds drops out), else the clearly
slower would take budget for 5 rounds each.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, replace

MIN_GAIN = 0.05  # a candidate replaces the default only if its paired gain is at least this at CONFIDENCE
CONFIDENCE = 0.95  # one-sided confidence of the sign-test upper bound on the median paired ratio (to replace)
DROP_CONFIDENCE = 1 - 0.5 ** 3  # of the lower bound (to drop out): 87.5%, the most the first 3 rounds allow
BUDGET_SHARE, BUDGET_STEPS = 0.2, 600  # measuring may cost 20% of a 600-step run of the default layout


def budget_s(default_step_s: float, share: float = BUDGET_SHARE) -> float:
    """Seconds ``--layout auto`` may spend measuring: ``share`` (default ``BUDGET_SHARE``) of ``BUDGET_STEPS``
    steps of the default layout (``default_step_s`` seconds each)."""
    return share * BUDGET_STEPS * default_step_s


def steady_step(times) -> float:
    """The default layout's step for the budget: the lower quartile of its timed steps (seconds; the one step
    when there is one). A 600-step run holds one layout, while the race holds every candidate and interleaves
    them, and its steps ran 1.2x the benchmark's own measurement of the same layout (4 gloo ranks, quiet host,
    2026-11-28): the median would let a slowed race widen its own budget."""
    t = sorted(times)
    return t[0] if len(t) < 2 else statistics.quantiles(t, n=4, method="inclusive")[0]


def _order_rank(n: int, confidence: float) -> int | None:
    """The least ``k`` (1-based) with ``P(Binomial(n, 1/2) <= k - 1) >= confidence``: the ``k``-th smallest of
    ``n`` samples is a one-sided upper confidence bound of their median at ``confidence`` (and the ``k``-th largest
    a lower one); None when no ``k <= n`` reaches it (too few samples)."""
    cdf = 0.0
    for k in range(1, n + 1):
        cdf += math.comb(n, k - 1) / 2 ** n
        if cdf >= confidence:
            return k
    return None


def paired_ratios(default_times, times) -> list[float]:
    """The paired ratios ``times[i] / default_times[i]`` (dimensionless; < 1: the candidate faster) of the rounds
    both took (step ``i`` of each comes from the same interleaved round; the shorter one's length)."""
    return [t / d for d, t in zip(default_times, times, strict=False) if d > 0]


@dataclass
class Paired:
    """A candidate against the default on paired rounds: ``n`` pairs, ``ratio`` (the median paired ratio),
    ``low``/``high`` (one-sided ``CONFIDENCE`` sign-test bounds of the median ratio: ``-inf``/``inf`` when too few
    pairs; ``high`` at ``CONFIDENCE``, ``low`` at ``DROP_CONFIDENCE``). Its gain is ``1 - ratio``, at least
    ``1 - high`` and at most ``1 - low``."""

    n: int
    ratio: float
    low: float
    high: float

    @classmethod
    def of(cls, default_times, times) -> Paired:
        """The paired statistics of ``times`` against ``default_times`` (seconds, :func:`paired_ratios`): ``high``
        at ``CONFIDENCE``, ``low`` at ``DROP_CONFIDENCE``."""
        r = sorted(paired_ratios(default_times, times))
        if not r:
            return cls(0, math.nan, -math.inf, math.inf)
        hi, lo = _order_rank(len(r), CONFIDENCE), _order_rank(len(r), DROP_CONFIDENCE)
        return cls(len(r), statistics.median(r), r[-lo] if lo else -math.inf, r[hi - 1] if hi else math.inf)

    @property
    def better(self) -> bool:
        """Replaces the default: the gain is at least ``MIN_GAIN`` at ``CONFIDENCE`` (the upper bound of the median
        ratio at most ``1 - MIN_GAIN``), not merely by the median. A median gain of ``MIN_GAIN`` with only a
        smaller gain significant (measured: 5.0% by the median of 34 paired rounds, 2.4% at 95%, on 4 gloo ranks
        sharing 2 cores) is within the noise another measurement of the same two layouts shows (there 8% the
        other way), so the default stays: replacing it must not risk a slower run."""
        return self.high <= 1 - MIN_GAIN

    @property
    def ruled_out(self) -> bool:
        """Cannot be ``MIN_GAIN`` faster at ``DROP_CONFIDENCE``: the lower bound of the ratio above ``1 - MIN_GAIN``
        (significantly slower, or a gain below the minimum)."""
        return self.low > 1 - MIN_GAIN

    def interval(self) -> str:
        """The gain's one-sided bounds, for the reason line."""
        lo = "-inf" if not math.isfinite(self.high) else f"{100 * (1 - self.high):.1f}%"
        hi = "+inf" if not math.isfinite(self.low) else f"{100 * (1 - self.low):.1f}%"
        return (f"gain >= {lo} at {100 * CONFIDENCE:.0f}% and <= {hi} at {100 * DROP_CONFIDENCE:.1f}% one-sided "
                f"(sign test, {self.n} pairs)")


@dataclass
class Decision:
    """:func:`decide`'s answer: ``index`` (into the candidates) of the one to train with, ``challenger`` (the
    index of the least median paired ratio other than the default; None when none), ``gain`` (its median paired
    gain: 1 - the median of its steps over the default's of the same rounds), ``paired`` (:class:`Paired`; None
    without a default or challenger) and ``reason`` (one line, printed in the table)."""

    index: int
    challenger: int | None
    gain: float
    paired: Paired | None
    reason: str

    @property
    def undecided(self) -> bool:
        """The challenger neither replaces the default nor is ruled out (:class:`Paired`): more rounds could
        decide."""
        p = self.paired
        return p is not None and not p.better and not p.ruled_out


def decide(cands) -> Decision:
    """Which measured candidate to train with: the default layout, unless the challenger (the least median paired
    ratio of its steps over the default's of the same rounds; ties to the cost model's order, ``cands``' order)
    is at least ``MIN_GAIN`` faster at ``CONFIDENCE``: the one-sided upper bound of the median ratio (sign test,
    :class:`Paired`) at most ``1 - MIN_GAIN``. Otherwise (ties, gains within the noise or
    too few rounds) the default stays. With no default among ``cands`` (it did not fit ``--memory-limit``) the
    least median step wins. Under torchrun ``cands``' times are the slowest rank's (an all-reduce max), so every
    rank decides alike. ``cands``: objects with ``times`` (seconds), ``default`` and ``layout``
    (:class:`meshtorch.runtime.autolayout.Candidate`)."""
    med = [statistics.median(c.times or (math.inf,)) for c in cands]
    d = next((i for i, c in enumerate(cands) if c.default), None)
    others = [i for i in range(len(cands)) if i != d]
    if d is None:
        ch = min(others, key=lambda i: (med[i], i)) if others else None
        return Decision(ch, ch, 0.0, None, "no default layout measured: the least median")
    if not others:
        return Decision(d, None, 0.0, None, "only the default layout measured")
    finite = [i for i in others if math.isfinite(med[i])]
    if not finite:
        return Decision(d, others[0], 0.0, None, "default kept: no other candidate finished its steps")
    if not math.isfinite(med[d]):
        ch = min(finite, key=lambda i: (med[i], i))
        name = cands[ch].layout or "(replicated)"
        return Decision(ch, ch, 1.0, None, f"default replaced: {name}; the default did not finish its steps")
    paired = {i: Paired.of(cands[d].times, cands[i].times) for i in finite}
    ch = min(finite, key=lambda i: (paired[i].ratio, i))
    p, name = paired[ch], cands[ch].layout or "(replicated)"
    gain = 1 - p.ratio
    why = (f"{name} {100 * gain:.1f}% faster (median paired ratio of {p.n} interleaved rounds) than the default "
           f"layout, {p.interval()}; it must be >= {100 * MIN_GAIN:.0f}% at {100 * CONFIDENCE:.0f}%")
    if p.better:
        return Decision(ch, ch, gain, p, f"default replaced: {why}")
    if gain <= 0:
        why = (f"{name}, the fastest other, is not faster (median paired ratio {p.ratio:.3f}, "
               f"{p.interval()})")
    return Decision(d, ch, gain, p, f"default kept: {why}")


def in_contention(cands, dropped: set) -> list[int]:
    """Indices of the candidates that race on: the default and every other candidate with finite steps, not in
    ``dropped``; an empty list when the decision is clear: the challenger (:func:`decide` over the candidates not
    dropped) replaces the default, or every other is dropped. Candidates ruled out (:attr:`Paired.ruled_out`:
    significantly slower, or significantly less than ``MIN_GAIN`` faster) are added to ``dropped`` (indices)
    first, for good: they get no more steps and cannot be chosen."""
    d = next((i for i, c in enumerate(cands) if c.default), None)
    if d is None:
        return []
    finite = [i for i, c in enumerate(cands) if c.times and all(math.isfinite(t) for t in c.times)]
    dropped.update(i for i in finite if i != d and i not in dropped
                   and Paired.of(cands[d].times, cands[i].times).ruled_out)
    live = [i for i in range(len(cands)) if i not in dropped]
    if live[decide([cands[i] for i in live]).index] != d:
        return []
    out = [i for i in finite if i != d and i not in dropped]
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
            return how + ("stopped: decided, the challenger is at least 5% faster than the default at 95% "
                          "confidence (sign test on paired rounds)")
        return how + ("stopped: decided, every other candidate dropped out (ruled out: significantly slower or "
                      "significantly less than 5% faster, sign test on paired rounds)")


def race(held, spent: float, share: float = BUDGET_SHARE, agree=lambda v: v) -> Race:
    """Race the ``held`` candidates (``[(candidate, step)]``, ``step()`` runs one timed step and returns its
    seconds; each candidate already has its first timed steps in ``times``) until the decision is clear or the
    budget is spent. The budget (:func:`budget_s` with ``share``) is set before each round from the default's
    timed steps so far (:func:`steady_step`); ``spent`` is the seconds already spent choosing (ranking, builds,
    warm-ups and steps), and each raced step adds its wall time (at least the seconds it returns). Before each
    round, on the slowest rank's steps (``agree``: an all-reduce max over the ranks of a list of floats; identity in one
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
        log.spent_s = flat[-1]
        log.budget_s = budget_s(steady_step(next(c for c in seen if c.default).times), share)
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
