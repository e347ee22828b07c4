"""Gradient buckets: several all-reduces of one plan issued as one collective call (DDP's buckets).

A data-parallel step sums every gradient over the data axis; one call per variable pays the
collective's fixed latency once per variable (gloo: tens to hundreds of microseconds each).
:func:`bucket_allreduces` merges SUM all-reduces over the same mesh axes into ``allreduce_bucket``
steps of at most ``cap_bytes`` per processor, each placed right after the last of its members'
inputs is computed and before the first use of any member's result, so the order stays valid and is
the same on every rank. The bytes moved, and so the counters, do not change; only the number of
calls does. Source: PyTorch DistributedDataParallel's gradient buckets (``bucket_cap_mb``).
"""

from __future__ import annotations

from meshtorch.lowering.program import Step


def bucket_allreduces(steps: list, cap_bytes: int) -> list:
    """``steps`` with runs of compatible all-reduces merged into ``allreduce_bucket`` steps."""
    if cap_bytes <= 0:
        return steps
    made = {o: i for i, st in enumerate(steps) for o in st.outputs}
    first_use: dict[int, int] = {}
    for i, st in enumerate(steps):
        for s in st.inputs:
            first_use.setdefault(s, i)

    def ready(i):
        return max([made.get(s, -1) for s in steps[i].inputs] + [-1])

    def need(i):
        return min(first_use.get(o, len(steps)) for o in steps[i].outputs)

    groups: dict[tuple, list[int]] = {}
    for i, st in enumerate(steps):
        if st.kind == "allreduce" and st.params.get("reduction") == "SUM":
            groups.setdefault((st.mesh, tuple(st.params["mesh_axes"])), []).append(i)
    buckets: list[list[int]] = []
    for idxs in groups.values():
        cur: list[int] = []
        hi_ready, lo_need, size = -1, len(steps), 0
        for i in sorted(idxs, key=ready):
            r, n, b = ready(i), need(i), steps[i].collective.bytes_per_processor
            if cur and (max(hi_ready, r) >= min(lo_need, n) or size + b > cap_bytes):
                buckets.append(cur)
                cur, hi_ready, lo_need, size = [], -1, len(steps), 0
            cur.append(i)
            hi_ready, lo_need, size = max(hi_ready, r), min(lo_need, n), size + b
        buckets.append(cur)
    after: dict[int, list[Step]] = {}
    members = set()
    for b in buckets:
        if len(b) < 2:
            continue
        members.update(b)
        sts = [steps[i] for i in b]
        merged = Step("allreduce_bucket", sts[0].op, tuple(s for st in sts for s in st.inputs),
                      tuple(o for st in sts for o in st.outputs), sts[0].mesh, None,
                      {"mesh_axes": tuple(sts[0].params["mesh_axes"]), "reduction": "SUM"})
        after.setdefault(max(ready(i) for i in b), []).append(merged)
    out = list(after.get(-1, []))
    for i, st in enumerate(steps):
        if i not in members:
            out.append(st)
        out.extend(after.get(i, []))
    return out
