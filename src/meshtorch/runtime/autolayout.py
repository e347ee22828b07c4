"""``meshtorch train --layout auto``: the layout (and, with ``--storage auto``, storage rules) the calibrated
cost model ranks fastest on this machine, within a memory limit.

Mesh TF shipped the same idea as ``auto_mtf`` (a cost model over layouts); here the model's constants are
measured on the machine that will run the job (:mod:`meshtorch.runtime.calibrate`), and
``benchmarks/layout_ranking.py`` measures how well its order matches measured step times.
"""

from __future__ import annotations

from meshtorch.core.errors import UsageError
from meshtorch.lowering.counters import _human
from meshtorch.planning.command import plan_lm, why_line
from meshtorch.runtime.calibrate import calibrate


def choose_layout(config, mesh_shape: str, storage: str = "", memory_limit: int | None = None,
                  backend: str = "placement", threads: int = 1, print_fn=print,
                  microbatches: int | None = None) -> tuple[str, str, str | None]:
    """``(layout rules, storage rules, remat)`` of the fastest legal layout of the LM on ``mesh_shape`` under the
    calibrated cost model of ``backend`` with ``threads`` torch threads per process.

    Args:
        config: ``fn(vocab_multiple) -> LMConfig`` (the vocab is padded for whichever mesh axis splits it).
        storage: ``"auto"`` searches storage rules too (FSDP / ZeRO-3); other rules are kept as given.
        memory_limit: bytes per processor; layouts predicted above it are left out (and storage rules are
            searched to bring one under it).
        backend: what runs the job: ``"placement"`` (one process simulating the mesh), ``"gloo"``/``"nccl"``.
        print_fn: receives the calibration summary line and the choice with its reason.
        microbatches: ``train --microbatches`` (> 1): pipelined layouts (``stage:<axis>``, docs/pipeline.md) with
            this many microbatches are searched too; None or 1: not (the config's microbatches are what
            training would use, so only a given M is searched).

    Returns:
        the layout rules, the storage rules (``""``: none), and None or the heavier ``--remat`` policy
        (``"block"``/``"selective"``) without which no layout fits ``memory_limit``.

    Raises:
        UsageError: if no legal layout fits ``memory_limit``, naming the limit.
    """
    cal = calibrate(backend, threads)  # measured once per host/backend/threads, then read from the cache
    cost = cal.cost_model()
    try:
        ranked = plan_lm(config, mesh_shape, search=True, storage=storage, memory_limit=memory_limit, cost=cost,
                         print_fn=lambda *a: None, microbatches=microbatches,
                         pipelines=microbatches is not None and microbatches > 1)
    except SystemExit as e:
        raise UsageError(f"--layout auto: {e}") from None
    if not ranked:
        within = f" within --memory-limit {_human(memory_limit)}" if memory_limit is not None else ""
        raise UsageError(f"--layout auto: no legal layout of mesh {mesh_shape!r} fits{within}; raise the limit, "
                         "add --storage auto, or use a larger mesh.")
    layout, rep = ranked[0]
    t = rep.estimated_time
    print_fn(f"--layout auto: {layout or '(replicated)'}" + (f" with storage {rep.storage}" if rep.storage else "")
             + f": predicted {t['total_s'] * 1e3:.1f} ms per step ({t['compute_s'] * 1e3:.1f} compute, "
             f"{t['comm_s'] * 1e3:.1f} communication), {rep.total_bytes / 2 ** 20:.1f} MiB per processor; best of "
             f"{len(ranked)} legal layouts under {cost.name}. {why_line(ranked)}")
    if rep.remat:
        print_fn(f"--layout auto: it fits only with --remat {rep.remat}, which this run uses.")
    return layout, rep.storage or "", rep.remat
