"""``meshtorch train --layout auto``: predict, then measure. The calibrated cost model ranks every legal layout
(and, with ``--storage auto``, storage rules) within a memory limit; train's default layout, the best
``--auto-candidates`` and every layout predicted within the ranking's trust band of the best are then trained
for a few steps each on the real mesh and backend (within a budget of 20% of a 600-step default run), and the
run trains with the default layout unless a challenger is at least 5% faster by the median of its paired
ratios to the default (steps of the same interleaved round) and significantly so (the sign test's 95% upper
bound of that median below 1, :func:`decide`), so ``--layout auto`` does not trade the default for a layout that
only a few noisy steps put ahead. While the rounds cannot tell, the default and the candidates not ruled out
race on for more interleaved rounds, those ruled out dropping out, until the decision is clear or the budget
is spent (:mod:`meshtorch.runtime.autorace`). The choice is cached, so a second run of the
same job measures nothing.

Mesh TF shipped a cost model over layouts (``auto_mtf``); measuring the model's best candidates on the machine
before committing to one is what cuDNN's benchmark mode (``torch.backends.cudnn.benchmark``) and Inductor's
``max-autotune`` do for kernels. The cost model's constants are measured on the machine that will run the job
(:mod:`meshtorch.runtime.calibrate`); ``benchmarks/layout_ranking.py`` measures how well its order matches
measured step times.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
import time
from dataclasses import dataclass, replace

import torch

from meshtorch._version import __version__
from meshtorch.core.errors import UsageError
from meshtorch.core.mesh_spec import MeshSpec
from meshtorch.data.sharding import local_batch_indices, local_feed
from meshtorch.lowering import Lowering
from meshtorch.lowering.counters import _human
from meshtorch.mesh.factory import make_mesh_impl
from meshtorch.mesh.process import broadcast_object, init_distributed, is_main_process, max_over_ranks
from meshtorch.ops.precision import PrecisionPolicy
from meshtorch.optim.adam import AdamWOptimizer
from meshtorch.planning.search import layout_key
from meshtorch.runtime import plan_lm as plans
from meshtorch.runtime.autorace import BUDGET_SHARE, BUDGET_STEPS, CONFIDENCE, MIN_GAIN, Race, budget_s, decide, race
from meshtorch.runtime.calibrate import _host_key, cache_path, calibrate
from meshtorch.runtime.plan_lm import DEFAULT_LAYOUT, backend_options, pipeline_fields, plan_lm, why_line

WARMUP_STEPS = 1  # excluded: the first step builds the executor's program and allocates the optimizer state
TIMED_STEPS = 3  # median of these
GIVE_UP = 3.0  # one process: a candidate whose first timed step takes this many times the best first stops
MODEL_ERROR = 0.25  # the least trust band: the cost model's median error against measured steps (docs/planning.md)


@dataclass
class Candidate:
    """One layout ``--layout auto`` may measure: its rules, storage rules, the ``--remat`` it needs (None: the
    run's), whether it is pipelined, the cost model's seconds per step and bytes per processor, whether it is
    train's default layout for the mesh, and (once measured) its step times in seconds."""

    layout: str
    storage: str
    remat: str | None
    pipelined: bool
    predicted_s: float
    total_bytes: int
    default: bool = False
    times: tuple = ()
    note: str = ""

    @property
    def measured_s(self) -> float:
        """Median measured step time (inf: not measured, or given up on as too slow)."""
        return statistics.median(self.times) if self.times else math.inf


def default_layout_for(mesh_shape: str) -> str:
    """``meshtorch train``'s default layout for ``mesh_shape``: ``DEFAULT_LAYOUT`` (data x Megatron model
    parallel) when the mesh has the axes it names, else data parallel over the first mesh axis
    (``batch:<axis>``, what DistributedDataParallel does; ``""`` on a mesh without axes)."""
    axes = [d.name for d in MeshSpec(mesh_shape).shape]
    named = {p.split(":")[1] for p in DEFAULT_LAYOUT.split(";")}
    if named <= set(axes):
        return DEFAULT_LAYOUT
    return f"batch:{axes[0]}" if axes else ""


def choose_layout(config, mesh_shape: str, storage: str = "", memory_limit: int | None = None,
                  backend: str = "placement", threads: int = 1, print_fn=print,
                  microbatches: int | None = None, candidates: int = 3, device: str | None = None,
                  executor: str = "codegen", world: int = 1, cache: bool = True,
                  precision=None, budget_share: float = BUDGET_SHARE) -> tuple[str, str, str | None]:
    """``(layout rules, storage rules, remat)`` of the fastest measured of the cost model's best layouts of
    the LM on ``mesh_shape``.

    The calibrated cost model of ``backend`` with ``threads`` torch threads ranks every legal layout. The layouts
    measured (:func:`select`) are the mesh's default layout (:func:`default_layout_for`, when it fits
    ``memory_limit``), then in predicted order the best ``candidates`` and every layout predicted within the
    trust band (:func:`trust_band`: the calibration's spread, at least ``MODEL_ERROR``) of the best prediction,
    as long as measuring them is predicted to cost at most ``BUDGET_SHARE`` of ``BUDGET_STEPS`` steps of the
    default layout; while measuring, the real seconds spent are checked against that budget (set from the
    default's measured step) before each candidate starts (:func:`_measure`). Each is trained for
    ``WARMUP_STEPS`` + ``TIMED_STEPS`` AdamW steps on a random batch on the real mesh (:func:`prepare_candidate`),
    the later timed steps in interleaved rounds (so a load that comes and goes on the host hits all alike; one
    candidate after another under ``memory_limit``, so only one is held at a time); the default layout is kept
    unless a challenger is at least ``MIN_GAIN`` faster at ``CONFIDENCE`` by its paired ratios (its step over the
    default's of the same interleaved round): the sign test's one-sided ``CONFIDENCE`` upper bound of their
    median at most ``1 - MIN_GAIN`` (:func:`decide`; F-race's blocked test, Birattari et al. 2002). While
    undecided, the default and every candidate not ruled out race on: one more timed step each per interleaved
    round, in alternating order, those ruled out (lower bound of the ratio above ``1 - MIN_GAIN``) dropping
    out for good, until the decision is clear or the next round would exceed the budget, now ``budget_share`` of
    ``BUDGET_STEPS`` of the default's lower-quartile timed step (:func:`meshtorch.runtime.autorace.race`, as
    F-race and successive halving; not under ``memory_limit``, where only one candidate is held). Under torchrun
    (``world`` > 1) every rank measures the same candidates in the same order, the budget is checked on the
    slowest rank's seconds and the slowest rank's steps count (an all-reduce max), so all ranks choose alike.
    The table printed gives each candidate's predicted and median measured step, the range of its timed steps,
    how many timed steps it got, the choice, which dropped out, how many rounds the race ran and why it stopped,
    and why the default was kept or replaced (the median gain, its confidence bounds and the pairs). The choice
    is cached (:func:`cache_file`) and read back by the next run of the same job, which then measures nothing.

    Args:
        config: ``fn(vocab_multiple) -> LMConfig`` (the vocab is padded for whichever mesh axis splits it), or
            ``-> HFModelConfig`` for an imported decoder-only model (``train --init-from``: its graph is ranked
            and its candidates measured on freshly initialised weights; the checkpoint is loaded afterwards, into
            the chosen layout). The cache key holds the whole config, the imported ``config.json`` included.
        storage: ``"auto"`` searches storage rules too (FSDP / ZeRO-3); other rules are kept as given.
        memory_limit: bytes per processor; layouts predicted above it are neither ranked nor measured (and
            storage rules are searched to bring one under it).
        backend: what runs the job: ``"placement"`` (one process simulating the mesh), ``"gloo"``/``"nccl"``.
        print_fn: receives the calibration line, the table of candidates and the choice with its reason.
        microbatches: ``train --microbatches`` (> 1): pipelined layouts (``stage:<axis>``, docs/pipeline.md) with
            this many microbatches are searched too; None or 1: not.
        candidates: how many of the cost model's best layouts to measure at least (``--auto-candidates``; the
            budget permitting: the first is always measured); 0: none, the cost model's first is taken without
            measuring (nor the default layout measured).
        device, executor: ``train --device`` / ``--executor``, what the measured steps run on.
        world: the job's process count (torchrun's ``WORLD_SIZE``).
        cache: read a cached choice (False: measure anyway; the new choice is cached either way).
        precision: ``train --precision``'s :class:`~meshtorch.ops.precision.PrecisionPolicy` (or its name): the
            ranking prices bytes and FLOPs in its compute dtype and the measured steps run under it.
        budget_share: the share of ``BUDGET_STEPS`` (600) steps of the default layout that choosing may cost
            (default ``BUDGET_SHARE``, 0.2, the issue's 20%): seconds = share x 600 x the default's measured
            step (its first timed step while candidates start; for the race the lower quartile of its timed
            steps, :func:`~meshtorch.runtime.autorace.steady_step`).

    Returns:
        the layout rules, the storage rules (``""``: none), and None or the heavier ``--remat`` policy
        (``"block"``/``"selective"``) without which the chosen layout does not fit ``memory_limit``.

    Raises:
        UsageError: if no legal layout fits ``memory_limit``, naming the limit; ``candidates`` < 0;
            ``budget_share`` not > 0.
    """
    if candidates < 0:
        raise UsageError(f"--auto-candidates must be >= 0, got {candidates}.")
    if not budget_share > 0:
        raise UsageError(f"--layout auto: the measuring budget share must be > 0 (a share of {BUDGET_STEPS} "
                         f"default steps), got {budget_share}.")
    t_rank = time.perf_counter()  # the ranking counts against the budget too
    cal = calibrate(backend, threads)  # measured once per host/backend/threads, then read from the cache
    cost = cal.cost_model(processes=world)  # more ranks than cores: they time-share them
    try:
        ranked = plan_lm(config, mesh_shape, search=True, storage=storage, memory_limit=memory_limit, cost=cost,
                         print_fn=lambda *a: None, microbatches=microbatches, precision=precision,
                         pipelines=microbatches is not None and microbatches > 1, options=backend_options(backend))
    except SystemExit as e:
        raise UsageError(f"--layout auto: {e}") from None
    if not ranked:
        within = f" within --memory-limit {_human(memory_limit)}" if memory_limit is not None else ""
        raise UsageError(f"--layout auto: no legal layout of mesh {mesh_shape!r} fits{within}; raise the limit, "
                         "add --storage auto, or use a larger mesh.")
    head = (f"--layout auto: {len(ranked)} legal layouts of mesh {mesh_shape!r}"
            + (f" within {_human(memory_limit)}" if memory_limit is not None else "") + f" ranked by {cost.name}")
    if candidates == 0:
        layout, rep = ranked[0]
        t = rep.estimated_time
        print_fn(f"{head}; --auto-candidates 0: taking the first unmeasured, {layout or '(replicated)'}"
                 + (f" with storage {rep.storage}" if rep.storage else "")
                 + f", predicted {t['total_s'] * 1e3:.1f} ms per step. {why_line(ranked)}")
        return _result(layout, rep.storage or "", rep.remat, print_fn)
    key = _cache_key(config, mesh_shape, storage, memory_limit, backend, threads, microbatches, candidates, device,
                     executor, world, precision, budget_share)
    hit = _agreed(_read_cache(key) if cache else None, world, backend)
    if hit is not None:
        print_fn(f"{head}; using the choice cached {hit['when']} ({cache_file(key)}; delete it to measure again), "
                 f"measured 0 candidates:")
        print_fn(hit["table"])
        return _result(hit["layout"], hit["storage"], hit["remat"], print_fn)
    cands = _candidates(config, mesh_shape, ranked, storage, memory_limit, cost, print_fn, precision,
                        backend_options(backend))
    band = trust_band(cost)
    chosen_ones = select(cands, candidates, band, budget_share)
    t0 = time.perf_counter()
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        measured, raced = _measure(chosen_ones, lambda c: prepare_candidate(
            config, mesh_shape, c, microbatches=microbatches, device=device, executor=executor, precision=precision),
            hold=memory_limit is None, world=world, share=budget_share, spent=time.perf_counter() - t_rank)
    finally:
        torch.set_num_threads(old)
    for c in measured:  # inf: left the race after its first step
        c.times += (math.inf,) * (TIMED_STEPS - len(c.times))
    flat, at = _max_over_ranks([t for c in measured for t in c.times], world), 0  # the slowest rank's steps
    for c in measured:
        c.times, at = tuple(flat[at:at + len(c.times)]), at + len(c.times)
    decision = decide(measured)
    if measured[decision.index].note:  # dropped out of the race (ruled out then): not chosen
        pool = [c for c in measured if not c.note]
        decision = decide(pool)
        decision.index = next(i for i, c in enumerate(measured) if c is pool[decision.index])
        decision.reason += "; the best by the median dropped out of the race earlier, ruled out then"
    chosen = decision.index
    table = (_table(measured, chosen_ones[len(measured):], chosen) + f"\n  {raced.line(budget_share)}"
             + f"\n  {decision.reason}")
    print_fn(f"{head}; measured {len(measured)} of them ({_why(chosen_ones, measured, candidates, band, budget_share)}"
             f"; {WARMUP_STEPS} warm-up + {TIMED_STEPS} timed steps each, then raced while undecided, median"
             f"{', slowest rank' if world > 1 else ''}) in {time.perf_counter() - t0:.1f} s:")
    print_fn(table)
    c = measured[chosen]
    _write_cache(key, {"layout": c.layout, "storage": c.storage, "remat": c.remat, "table": table,
                       "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}, world)
    return _result(c.layout, c.storage, c.remat, print_fn)


def trust_band(cost) -> float:
    """How far apart (relative) two predicted step times must be before the ranking may decide between them
    without measuring: the calibration's spread (``cost.spread``, :func:`meshtorch.planning.search.trust_line`),
    and at least ``MODEL_ERROR`` (the cost model's median error against measured step times, docs/planning.md)."""
    return max(cost.spread or 0.0, MODEL_ERROR)


def select(cands: list[Candidate], k: int, band: float, share: float = BUDGET_SHARE) -> list[Candidate]:
    """The candidates worth measuring, in the order to measure them: the default layout first (the fallback,
    and its measured step sets the budget), then in predicted order every candidate among the best ``k`` or
    predicted within ``band`` (relative) of the best prediction, while the predicted cost of measuring them
    (:func:`measuring_cost`) stays within the budget (:func:`budget_s` of the default's prediction); the cost
    model's first is always kept. ``cands``: every ranked layout, best first, the default marked."""
    ranked = [c for c in cands if not c.default]
    default = next((c for c in cands if c.default), None)
    best = min((c.predicted_s for c in cands), default=0.0)
    budget = budget_s(default.predicted_s if default is not None else best, share)
    out = [default] if default is not None else []
    spent = sum(measuring_cost(c.predicted_s) for c in out)
    for i, c in enumerate(ranked):
        if not (i < k or c.predicted_s <= best * (1 + band)):
            continue
        if i > 0 and spent + measuring_cost(c.predicted_s) > budget:
            break
        out.append(c)
        spent += measuring_cost(c.predicted_s)
    return out


def measuring_cost(step_s: float) -> float:
    """Predicted seconds of measuring a candidate of ``step_s`` seconds per step (warm-up and timed steps; the
    build is not predicted, it is counted once spent)."""
    return (WARMUP_STEPS + TIMED_STEPS) * step_s


def _measure(cands: list[Candidate], prepare, hold: bool, world: int, share: float = BUDGET_SHARE,
             spent: float = 0.0) -> tuple[list[Candidate], Race]:
    """Measure ``cands`` in order (``prepare(c)``: builds ``c``, runs its warm-up and returns a function running
    one timed step and returning its seconds) until the budget is spent: ``budget_s`` (``share``) of the first's
    (the default's) first timed step. After the first two, a candidate is started only if the seconds spent so
    far (each build and warm-up as timed here plus the timed steps' seconds; the slowest rank's, so all ranks
    agree) plus its predicted measuring cost, scaled by the first's measured over predicted step, fit. Each
    started candidate takes its first timed step at once (one process: one slower than ``GIVE_UP`` x the best
    first step so far leaves the race); with ``hold`` the remaining ``TIMED_STEPS`` - 1 rounds are interleaved
    over the held candidates (a load that comes and goes hits all alike), else each candidate's steps run before
    the next is built (one held at a time, under ``--memory-limit``; no race then). Then the held candidates race
    (:func:`meshtorch.runtime.autorace.race`): while the decision is not clear, the default and the candidates
    not ruled out take more interleaved steps, those ruled out drop out, until it is or the budget (now
    from the default's lower-quartile timed step) is spent. Sets each measured candidate's ``times`` (and
    ``note`` for the dropped); returns the measured ones (a prefix of ``cands``) and what the race did.
    ``spent``: seconds already spent choosing (the ranking), counted against the budget."""
    held, done, budget, scale = [], [], math.inf, 1.0
    for c in cands:
        if len(done) >= 2:
            if _max_over_ranks([spent], world)[0] + scale * measuring_cost(c.predicted_s) > budget:
                break
        t0 = time.perf_counter()
        step = prepare(c)
        spent += time.perf_counter() - t0
        c.times = (step(),)
        if not done:  # the slowest rank's first step, so all ranks agree on the budget
            first = _max_over_ranks([c.times[0]], world)[0]
            budget = budget_s(first, share)
            scale = first / c.predicted_s if c.predicted_s > 0 else 1.0
        done.append(c)
        if world == 1 and c.times[0] > GIVE_UP * min(d.times[0] for d in done):
            spent += c.times[0]
            continue  # cannot win: no more steps
        if hold:
            held.append((c, step))
        else:
            c.times += tuple(step() for _ in range(TIMED_STEPS - 1))
        spent += TIMED_STEPS * c.times[0] if hold else sum(c.times)  # held: its later rounds, as its first
        del step
    for _ in range(TIMED_STEPS - 1):
        for c, step in held:
            c.times += (step(),)
    if not hold:
        return done, Race(stop="none", spent_s=_max_over_ranks([spent], world)[0], dropped={})
    log = race(held, spent, share, agree=lambda v: _max_over_ranks(v, world))
    for i, n in log.dropped.items():
        held[i][0].note = f"dropped after {n} steps: ruled out (not 5% faster at 95% confidence)"
    return done, log


def _why(chosen: list[Candidate], measured: list[Candidate], k: int, band: float, share: float) -> str:
    left = len(chosen) - len(measured)
    return (f"the default, the best {k} and those predicted within {100 * band:.0f}% of the best, up to "
            f"{100 * share:.0f}% of {BUDGET_STEPS} default steps"
            + (f"; {left} left unmeasured when the budget was spent" if left else ""))


def _result(layout: str, storage: str, remat: str | None, print_fn) -> tuple[str, str, str | None]:
    if remat:
        print_fn(f"--layout auto: it fits only with --remat {remat}, which this run uses.")
    return layout, storage, remat


def _candidates(config, mesh_shape, ranked, storage, memory_limit, cost, print_fn,
                precision=None, options=None) -> list[Candidate]:
    """Every layout of ``ranked`` as a :class:`Candidate`, best first, with the mesh's default layout marked
    (ranked, or predicted apart and appended; left out with a line saying why when it does not fit
    ``memory_limit`` or is illegal for the model)."""
    sizes = {d.name: d.size for d in MeshSpec(mesh_shape).shape}
    out = [Candidate(lay, r.storage or "", r.remat, r.pipeline is not None, r.estimated_time["total_s"],
                     r.total_bytes) for lay, r in ranked]
    default = default_layout_for(mesh_shape)
    dstore = "" if storage in ("", "auto") else storage
    want = layout_key(default, dstore, sizes)
    mine = next((c for c in out if layout_key(c.layout, c.storage, sizes) == want and not c.remat
                 and not c.pipelined), None)
    if mine is None:
        try:
            rep = plan_lm(config, mesh_shape, default, storage=dstore, cost=cost, print_fn=lambda *a: None,
                          precision=precision, options=options)[0][1]
        except SystemExit:
            print_fn(f"--layout auto: the default layout {default!r} is illegal for this model; not measured.")
            return out
        if memory_limit is not None and rep.total_bytes > memory_limit:
            print_fn(f"--layout auto: the default layout {default!r} needs {_human(rep.total_bytes)} per "
                     f"processor, over --memory-limit {_human(memory_limit)}; not measured.")
            return out
        mine = Candidate(default, rep.storage or "", None, False, rep.estimated_time["total_s"], rep.total_bytes)
        out.append(mine)
    mine.default = True
    return out


def candidate_config(config, mesh_shape: str, c: Candidate, microbatches: int | None = None):
    """The LMConfig that runs candidate ``c``: the vocab padded for the axis that splits it, ``c``'s remat, and
    for a pipelined layout the pipeline fields ``meshtorch train`` resolves from it."""
    cfg = config(MeshSpec(mesh_shape, c.layout).axis_size_for("vocab"))
    if c.remat:
        cfg = replace(cfg, remat=c.remat)
    if c.pipelined:
        cfg = replace(cfg, **pipeline_fields(mesh_shape, c.layout, microbatches, None, None, cfg.num_layers))
    return cfg


def prepare_candidate(config, mesh_shape: str, c: Candidate, microbatches: int | None = None,
                      device: str | None = None, executor: str = "codegen", warmup: int = WARMUP_STEPS,
                      precision=None):
    """A function running one timed AdamW training step of candidate ``c`` on the real mesh (the placement
    mesh in this process; under torchrun this rank's part of the SPMD mesh) on a random token batch and
    returning its seconds; the LM is built (under ``precision``, a PrecisionPolicy or its name) and lowered and
    ``warmup`` untimed steps run first."""
    cfg = candidate_config(config, mesh_shape, c, microbatches)
    lm = plans.model_builder(cfg)(cfg, optimizer=AdamWOptimizer(1e-3), precision=precision)
    impl = make_mesh_impl(mesh_shape, c.layout, device=device, storage=c.storage or None)
    lw = Lowering(lm.graph, {lm.mesh: impl}, mode=executor)
    time_steps(lm, lw, 0, warmup=warmup)
    seed = iter(range(1, 1 << 30))
    return lambda: time_steps(lm, lw, 1, seed=next(seed))[0]


def time_steps(lm, lowering, steps: int, warmup: int = 0, seed: int = 0) -> list:
    """Seconds of each of ``steps`` training steps (loss and updates fetched, the loss read back: a device
    synchronization) of the LM ``lm`` under ``lowering``, after ``warmup`` untimed ones; each step feeds a
    random int64 token batch ``[batch, length + 1]`` (inputs and targets shifted by one), only the rows this
    process's slices hold (``feed_slices=True``)."""
    g = torch.Generator().manual_seed(seed)
    c = lm.config
    times = []
    for i in range(warmup + steps):
        b = torch.randint(0, c.vocab_size, (c.batch_size, c.length + 1), generator=g)
        feeds = {t: local_feed(lowering, t, v[local_batch_indices(lowering, t)])
                 for t, v in ((lm.inputs, b[:, :-1]), (lm.targets, b[:, 1:]))}
        t0 = time.perf_counter()
        lowering.run([lm.loss] + lm.updates, feeds=feeds, feed_slices=True)[0].item()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def _table(measured: list[Candidate], unmeasured: list[Candidate], chosen: int) -> str:
    """The measured candidates (predicted, median and range of the timed steps, how many timed steps each got,
    which was chosen, which dropped out of the race or gave up) and those selected but left unmeasured when the
    budget was spent (:func:`choose_layout` adds the race's line and :func:`decide`'s reason)."""
    lines = [f"  {'layout':<48} {'storage':<16}{'predicted ms':>13}{'measured ms':>12}{'range ms':>16}{'steps':>6}  "]
    for i, c in enumerate(measured + unmeasured):
        med, n = c.measured_s, sum(math.isfinite(t) for t in c.times)
        if i >= len(measured):
            meas, spread, n = f"{'-':>12}", f"{'not measured':>16}", "-"
        elif math.isfinite(med):
            meas, spread = f"{med * 1e3:12.1f}", f"{min(c.times) * 1e3:7.1f}-{max(c.times) * 1e3:<8.1f}"
        else:
            meas, spread = f"{'gave up':>12}", f"{min(c.times) * 1e3:7.1f}{'':9}"
        mark = ("chosen" if i == chosen else "") + (" (default)" if c.default else "") + (f" {c.note}" if c.note
                                                                                          else "")
        lines.append(f"  {c.layout or '(replicated)':<48} {c.storage or '-':<16}{c.predicted_s * 1e3:13.1f}{meas}"
                     f"{spread}{n:>6}  {mark.strip()}")
    return "\n".join(lines)


def _cache_key(config, mesh_shape, storage, memory_limit, backend, threads, microbatches, candidates, device,
               executor, world, precision=None, budget_share=BUDGET_SHARE) -> dict:
    policy = PrecisionPolicy.of(precision)
    return {"model": config(1).to_dict(), "mesh": mesh_shape, "storage": storage, "memory_limit": memory_limit,
            "backend": backend, "threads": threads, "microbatches": microbatches, "candidates": candidates,
            "device": device, "executor": executor, "world": world, "host": _host_key(), "meshtorch": __version__,
            "steps": [WARMUP_STEPS, TIMED_STEPS, budget_share, BUDGET_STEPS, MODEL_ERROR, "lower-quartile budget"],
            "rule": ["default unless MIN_GAIN faster at CONFIDENCE by the sign test on paired rounds", MIN_GAIN,
                     CONFIDENCE, "raced while undecided"],
            "precision": [policy.name, str(policy.reduce_dtype)]}


def cache_file(key: dict) -> str:
    """Where the choice of the job ``key`` is cached: ``autolayout/<sha1 of the key>.json`` in the calibration's
    cache directory (``$MESHTORCH_CACHE_DIR``, default ``~/.cache/meshtorch``)."""
    root = os.path.dirname(os.path.dirname(cache_path("placement", 1)))
    digest = hashlib.sha1(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]
    return os.path.join(root, "autolayout", f"{digest}.json")


def _read_cache(key: dict) -> dict | None:
    try:
        with open(cache_file(key)) as f:
            hit = json.load(f)
    except (OSError, ValueError):
        return None
    return hit if isinstance(hit, dict) and hit.get("key") == json.loads(json.dumps(key, default=str)) else None


def _write_cache(key: dict, choice: dict, world: int) -> None:
    if world > 1 and not is_main_process():  # the process group's rank 0 writes (_agreed joined the group)
        return
    path = cache_file(key)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({"key": key, **choice}, f, indent=1, default=str)
    os.replace(tmp, path)


def _agreed(hit: dict | None, world: int, backend: str) -> dict | None:
    """Under torchrun, rank 0's cache hit (or miss) for every rank, so all measure or none does (joins the job
    first: ``--layout auto`` runs before training starts)."""
    if world <= 1:
        return hit
    init_distributed(backend=backend)
    return broadcast_object(hit, src=0)


def _max_over_ranks(values: list[float], world: int) -> list[float]:
    """``values`` (one per candidate); under torchrun their maximum over the ranks (the slowest rank)."""
    return values if world <= 1 else max_over_ranks(values)
