"""Scheduling passes over a plan's steps: buckets (several collectives issued as one call) and prefetch.

A data-parallel step sums every gradient over the data axis; an FSDP step also gathers every weight
and reduce-scatters every gradient. One call per variable pays the collective's fixed latency once
per variable (gloo: tens to hundreds of microseconds each, far more when processes outnumber cores
and every call is a synchronisation point). Two passes merge them, keeping the order valid and the
same on every rank; the bytes moved, and so the counters, do not change, only the number of calls:

- :func:`bucket_reductions` merges SUM all-reduces over the same mesh axes (``allreduce_bucket``)
  and reduce-scatters over the same mesh axis (``reduce_scatter_bucket``) into buckets of at most
  ``cap_bytes`` per processor, each placed right after the last of its members' inputs is computed
  and before the first use of any member's result. Source: PyTorch DistributedDataParallel's
  gradient buckets (``bucket_cap_mb``); FSDP's reduce-scatter of a unit's flat gradient.
- :func:`bucket_gathers` merges consecutive *weight* all-gathers (inputs computed from nothing but
  the values a run starts with: variables in their storage layout) over the same mesh axis into
  ``allgather_bucket`` steps of at most ``cap_bytes`` of *gathered* weights per processor (the outputs'
  bytes where the plan knows them, so a bucket never holds more than ``cap_bytes`` of unsharded weights),
  issued where the first member was: FSDP's all-gather of a unit's flat parameter. Gathered weights of a
  bucket are alive together, which the planner's memory walk sees.
- :func:`prefetch_gathers` issues each weight gather (or gather bucket) before the previous one is
  used: FSDP's forward and backward prefetch.

Every pass is a deterministic function of the steps, so every SPMD process issues the same
collectives in the same order.
"""

from __future__ import annotations

from meshtorch.lowering.collectives import BUCKETS, KINDS
from meshtorch.lowering.program import Step

#: the merged step kind of each collective kind that buckets (declared in :mod:`meshtorch.lowering.collectives`)
BUCKET_KINDS = {c.name: c.bucket for c in KINDS.values() if c.bucket}


def _first_use(steps) -> dict:
    first: dict[int, int] = {}
    for i, st in enumerate(steps):
        for s in st.inputs:
            first.setdefault(s, i)
    return first


def _merge(sts: list) -> Step:
    """One bucket step of collectives ``sts`` of the same kind, mesh and mesh axes."""
    c = KINDS[sts[0].kind]
    return Step(c.bucket, sts[0].op, tuple(s for st in sts for s in st.inputs),
                tuple(o for st in sts for o in st.outputs), sts[0].mesh, None, c.bucket_params(sts),
                members=tuple(c for st in sts for c in st.planned))


def _group_key(st):
    """Steps with the same key may share a reduction bucket (None: never bucketed here)."""
    c = KINDS.get(st.kind)
    return c.bucket_key(st) if c is not None and c.bucket_key is not None else None


def _gathers_weights(kind: str) -> bool:
    c = KINDS.get(kind) or BUCKETS.get(kind)
    return c is not None and c.weight_gather


#: DDP's first gradient bucket (``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``, 1 MiB)
FIRST_BUCKET_BYTES = 2 ** 20


def bucket_reductions(steps: list, cap_bytes: int, first_cap_bytes: int = 0) -> list:
    """``steps`` with runs of compatible all-reduces / reduce-scatters merged into bucket steps.

    ``first_cap_bytes`` > 0: as DistributedDataParallel's first bucket, the first all-reduce bucket of each
    group (mesh axes) closes as soon as it holds at least ``first_cap_bytes`` per processor, so the sum of
    the first gradients ready (the last layers') starts while the backward pass goes on; the other buckets
    hold at most ``cap_bytes``. Source: ``torch.nn.parallel.DistributedDataParallel``
    (``_DEFAULT_FIRST_BUCKET_BYTES``; its reducer closes a bucket once it reaches its limit).
    """
    if cap_bytes <= 0:
        return steps
    made = {o: i for i, st in enumerate(steps) for o in st.outputs}
    first_use = _first_use(steps)

    def ready(i):
        return max([made.get(s, -1) for s in steps[i].inputs] + [-1])

    def need(i):
        return min(first_use.get(o, len(steps)) for o in steps[i].outputs)

    groups: dict[tuple, list[int]] = {}
    for i, st in enumerate(steps):
        key = _group_key(st)
        if key is not None:
            groups.setdefault(key, []).append(i)
    buckets: list[list[int]] = []
    for idxs in groups.values():
        cur: list[int] = []
        hi_ready, lo_need, size = -1, len(steps), 0
        # the group's first bucket is open (all-reduces only: FSDP's reduce-scatters have no first bucket)
        first = 0 < first_cap_bytes < cap_bytes and KINDS[steps[idxs[0]].kind].first_bucket
        for i in sorted(idxs, key=ready):
            r, n, b = ready(i), need(i), steps[i].collective.bytes_per_processor
            full = size + b > cap_bytes or (first and size >= first_cap_bytes)
            if cur and (max(hi_ready, r) >= min(lo_need, n) or full):
                buckets.append(cur)
                cur, hi_ready, lo_need, size, first = [], -1, len(steps), 0, False
            cur.append(i)
            hi_ready, lo_need, size = max(hi_ready, r), min(lo_need, n), size + b
        buckets.append(cur)
    after: dict[int, list[Step]] = {}
    members = set()
    for b in buckets:
        if len(b) < 2:
            continue
        members.update(b)
        after.setdefault(max(ready(i) for i in b), []).append(_merge([steps[i] for i in b]))
    out = list(after.get(-1, []))
    for i, st in enumerate(steps):
        if i not in members:
            out.append(st)
        out.extend(after.get(i, []))
    return out


def _pull(steps, made: dict, key: list, i: int, k: float) -> None:
    """Give step ``i`` sort key ``k`` (if earlier than its own) and its input steps keys just below it,
    so a stable sort by key moves it up with everything it needs and keeps the order valid."""
    if k >= key[i]:
        return
    key[i] = k
    for s in steps[i].inputs:
        if s in made:
            _pull(steps, made, key, made[s], k - 1e-3)


def weight_gathers(steps: list) -> list[int]:
    """Indices of the all-gathers (single or bucketed) whose inputs depend on no computed activation,
    only on values a run starts with (variables, constants) through steps that do the same."""
    made = {o: i for i, st in enumerate(steps) for o in st.outputs}
    static = [False] * len(steps)
    for i, st in enumerate(steps):
        static[i] = (st.kind == "slicewise" or _gathers_weights(st.kind)) and all(
            s not in made or static[made[s]] for s in st.inputs)
    return [i for i, st in enumerate(steps) if static[i] and _gathers_weights(st.kind)]


def bucket_gathers(steps: list, cap_bytes: int, slot_bytes: dict | None = None) -> list:
    """``steps`` with consecutive weight all-gathers over the same mesh axis merged into
    ``allgather_bucket`` steps of at most ``cap_bytes`` per processor, each issued where its first member
    was (the other members' input steps move up with them). A member counts its gathered output's bytes
    (``slot_bytes``: ``{slot: per-processor bytes}``, the program's), else its recorded (shard) bytes: a
    bucket of shards adding up to ``cap_bytes`` would hold the group size times that of gathered weights."""
    if cap_bytes <= 0:
        return steps
    slot_bytes = slot_bytes or {}
    made = {o: i for i, st in enumerate(steps) for o in st.outputs}
    buckets: list[list[int]] = []
    cur: list[int] = []
    size = 0
    for i in weight_gathers(steps):
        st = steps[i]
        b = sum(slot_bytes.get(o, st.collective.bytes_per_processor) for o in st.outputs)
        if cur and (steps[cur[0]].mesh != st.mesh or steps[cur[0]].params["mesh_axis"] != st.params["mesh_axis"]
                    or size + b > cap_bytes):
            buckets.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += b
    buckets.append(cur)
    key = [float(i) for i in range(len(steps))]
    drop: set[int] = set()
    merged_at: dict[int, Step] = {}

    for b in buckets:
        if len(b) < 2:
            continue
        first = b[0]
        for i in b[1:]:
            drop.add(i)
            for s in steps[i].inputs:
                if s in made:
                    _pull(steps, made, key, made[s], first - 0.5)
        merged_at[first] = _merge([steps[i] for i in b])
    order = sorted((i for i in range(len(steps)) if i not in drop), key=lambda i: (key[i], i))
    return [merged_at.get(i, steps[i]) for i in order]


def prefetch_gathers(steps: list, depth: int = 1) -> list:
    """Issue each weight's all-gather ``depth`` gathers early: FSDP's forward and backward prefetch.

    The weight gathers (:func:`weight_gathers`, single or bucketed) are ``g_1, g_2, ...`` in plan
    order; ``g_{k+depth}`` (with the steps producing its input) moves to just before the first use
    of ``g_k``, so on an SPMD mesh with asynchronous collectives the next weight travels while the
    current one is used, and at most ``depth`` gathered weights beyond those in use are alive (the
    memory FSDP's prefetch costs, which the planner's memory walk sees because it walks this order).
    Deterministic in the program, so every process issues the same collectives in the same order.
    ``depth`` 0 returns ``steps``.
    """
    if depth <= 0:
        return steps
    made = {o: i for i, st in enumerate(steps) for o in st.outputs}
    gathers = weight_gathers(steps)
    if len(gathers) <= depth:
        return steps
    first_use = _first_use(steps)
    key = [float(i) for i in range(len(steps))]

    for g, ahead in zip(gathers, gathers[depth:], strict=False):
        use = min((first_use[o] for o in steps[g].outputs if o in first_use), default=None)
        if use is not None:
            _pull(steps, made, key, ahead, use - 0.5)
    order = sorted(range(len(steps)), key=lambda i: (key[i], i))
    return [steps[i] for i in order]


__all__ = ["BUCKET_KINDS", "bucket_gathers", "bucket_reductions", "prefetch_gathers", "weight_gathers"]
