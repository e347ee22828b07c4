"""Running functions in N gloo processes on loopback, and the SPMD op-suite check.

:func:`run_spmd` starts ``nprocs`` processes with torchrun's environment (forked from a fork server that has
torch and meshtorch imported, or ``python -m meshtorch.testing.spmd`` interpreters: :mod:`.spmd_start`), each
calls ``init_distributed`` and then ``target(*args)``; return values come back pickled, per rank. The whole job
is bounded by ``timeout_s`` (stragglers are killed), so a test never hangs. :func:`op_suite_worker` runs every
``OP_CASES`` entry of the given modules on :class:`~meshtorch.mesh.spmd.SpmdMeshImpl` and compares values and
gradients with :class:`~meshtorch.mesh.placement.PlacementMeshImpl` and with the unsplit PyTorch reference.
"""

from __future__ import annotations

import importlib
import os
import pickle
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

from meshtorch.mesh.spmd import SpmdMeshImpl
from meshtorch.runtime.launcher import free_port, launch_env
from meshtorch.testing.layouts import enumerate_layouts, reference_run, rel_error, run_layout
from meshtorch.testing.spmd_start import SRC_DIR, _child_main, start_ranks


@dataclass
class SpmdRun:
    """What :func:`run_spmd` observed: per-rank exit status, seconds until exit, stderr, return value."""

    returncodes: list
    exit_times: list
    stderr: list
    results: list
    timed_out: bool
    elapsed: float
    start_wall: float = 0.0  # time.time() when the processes were started

    def check(self):
        """Raise AssertionError with every failed rank's stderr unless all ranks exited 0."""
        if self.timed_out or any(c != 0 for c in self.returncodes):
            errs = "\n".join(f"--- rank {r} (status {c}):\n{e[-3000:]}" for r, (c, e) in
                             enumerate(zip(self.returncodes, self.stderr, strict=True)) if c != 0)
            raise AssertionError(f"SPMD job failed (timed out: {self.timed_out}); statuses {self.returncodes}\n{errs}")
        return self


def run_spmd(target: str, args=(), nprocs: int = 4, timeout_s: float = 120.0, dist_timeout_s: float = 30.0,
             extra_path=(), env=None) -> SpmdRun:
    """Run ``target`` ("module:function") in ``nprocs`` gloo processes; return an :class:`SpmdRun`.

    Args:
        args: picklable positional arguments for the function.
        timeout_s: wall-clock bound for the whole job; processes still alive then are killed.
        dist_timeout_s: the process-group timeout each process uses (``MESHTORCH_TIMEOUT``).
        extra_path: directories to put first on the children's ``sys.path`` and ``PYTHONPATH`` (e.g. ``tests/``).
        env: variables to set in the children's ``os.environ`` (before ``init_distributed``).

    The ranks are forked from a fork server that has torch and meshtorch imported, or started as fresh
    interpreters with ``MESHTORCH_SPMD_START=subprocess`` (:func:`meshtorch.testing.spmd_start.start_ranks`).
    """
    with tempfile.TemporaryDirectory(prefix="meshtorch-spmd-") as tmp:
        with open(os.path.join(tmp, "args.pkl"), "wb") as f:
            pickle.dump((target, tuple(args)), f)
        port = free_port()
        base = dict(os.environ)
        base.update(env or {})
        base["PYTHONPATH"] = os.pathsep.join([SRC_DIR, *extra_path, base.get("PYTHONPATH", "")])
        base["OMP_NUM_THREADS"] = "1"
        start, start_wall = time.monotonic(), time.time()
        procs = start_ranks(tmp, [launch_env(r, nprocs, port, base, dist_timeout_s) for r in range(nprocs)],
                            extra_path)
        exit_times = [None] * nprocs
        timed_out = False
        try:
            while any(t is None for t in exit_times):
                for r, p in enumerate(procs):
                    if exit_times[r] is None and p.poll() is not None:
                        exit_times[r] = time.monotonic() - start
                if time.monotonic() - start > timeout_s:
                    timed_out = True
                    break
                time.sleep(0.05)
        finally:  # on time-out, or an interrupt of the caller: no rank outlives the job
            for p in procs:
                if p.poll() is None:
                    p.kill()
        codes = [p.wait() for p in procs]
        elapsed = time.monotonic() - start
        stderr = []
        for r in range(nprocs):
            with open(os.path.join(tmp, f"rank{r}.err"), errors="replace") as f:
                stderr.append(f.read())
        results = []
        for r in range(nprocs):
            path = os.path.join(tmp, f"rank{r}.pkl")
            if os.path.exists(path):
                with open(path, "rb") as f:
                    results.append(pickle.load(f))
            else:
                results.append(None)
    return SpmdRun(codes, exit_times, stderr, results, timed_out, elapsed, start_wall)


# ====================================================================== the op suite on SPMD
def spmd_layouts(case, per_mesh: int = 2) -> list:
    """Up to ``per_mesh`` legal layouts on ``all:4`` and on ``rows:2;cols:2`` (replicated if none is legal)."""
    out = []
    for m in ("all:4", "rows:2;cols:2"):
        lays = enumerate_layouts(case.build, case.inputs, meshes=(m,), exclude=case.exclude)[:per_mesh]
        out += lays or [(m, "")]
    return out


def op_suite_worker(module_names, per_mesh: int = 2, rtol_vs_placement: float = 1e-6) -> dict:
    """Run every OP_CASES entry of ``module_names`` on SpmdMeshImpl; rank 0 compares.

    ``all:4`` runs use blocking all-reduces and ``rows:2;cols:2`` runs asynchronous ones, so both paths
    of :class:`~meshtorch.mesh.spmd.SpmdMeshImpl` see the whole suite.

    Returns (rank 0) ``{case name: [(mesh, layout, error message or None)]}``; other ranks ``{}``.
    """
    rank = dist.get_rank()
    report: dict = {}
    for name in module_names:
        torch.manual_seed(0)  # a case drawing its inputs from the global generator gets equal ones on every rank
        for case in getattr(importlib.import_module(name), "OP_CASES", []):
            key = f"{name}::{case.name}"
            report[key] = []
            if not _same_on_all_ranks(case.inputs):
                report[key].append(("", "", "the case's inputs differ between ranks (unseeded randomness?)"))
                continue
            for mesh_shape, layout in spmd_layouts(case, per_mesh):
                try:
                    outs, grads, _ = run_layout(case.build, case.inputs, mesh_shape, layout, grad=case.grad,
                                                make_impl=_make_spmd)
                    err = None
                    if rank == 0:
                        err = _compare(case, outs, grads, mesh_shape, layout, rtol_vs_placement,
                                       run_layout, reference_run, rel_error)
                except Exception:  # noqa: BLE001 - report per case; deterministic errors hit every rank alike
                    err = traceback.format_exc(limit=8)
                report[key].append((mesh_shape, layout, err))
    return report if rank == 0 else {}


def _make_spmd(mesh_shape, layout):
    return SpmdMeshImpl(mesh_shape, layout, async_collectives=(mesh_shape == "rows:2;cols:2"))


def _same_on_all_ranks(inputs) -> bool:
    sums = []
    for _, (_, v) in sorted(inputs.items()):
        v = torch.nan_to_num(v.detach().to(torch.float64).reshape(-1), nan=12345.0, posinf=1e300, neginf=-1e300)
        sums += [v.sum(), (v * torch.arange(1, v.numel() + 1, dtype=torch.float64)).sum()]
    x = torch.stack(sums) if sums else torch.zeros(1, dtype=torch.float64)
    lo, hi = x.clone(), x.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    return bool(torch.equal(lo, hi))


def _compare(case, outs, grads, mesh_shape, layout, rtol_p, run_layout, reference_run, rel_error):
    p_outs, p_grads, _ = run_layout(case.build, case.inputs, mesh_shape, layout, grad=case.grad)
    r_outs, r_grads = reference_run(case.reference, case.inputs, [o.dtype for o in outs], grad=case.grad)
    problems = []
    for what, mine, theirs, tol in (("placement", outs, p_outs, rtol_p), ("reference", outs, r_outs, case.rtol)):
        if len(mine) != len(theirs):
            problems.append(f"{len(mine)} outputs vs {len(theirs)} from {what}")
            continue
        for i, (a, b) in enumerate(zip(mine, theirs, strict=True)):
            if tuple(a.shape) != tuple(b.shape):
                problems.append(f"output {i} shape {tuple(a.shape)} vs {what} {tuple(b.shape)}")
            elif a.dtype.is_floating_point:
                e = rel_error(a, b)
                if not e <= tol:
                    problems.append(f"output {i} rel. error {e:.3g} vs {what} (> {tol})")
            elif not torch.equal(a, b.to(a.dtype)):
                problems.append(f"output {i} differs from {what}")
    for what, theirs, tol in (("placement", p_grads, rtol_p), ("reference", r_grads, case.rtol)):
        if case.grad and set(grads) != set(theirs):
            problems.append(f"gradients for {sorted(grads)} vs {what} {sorted(theirs)}")
            continue
        for n, g in grads.items():
            e = rel_error(g, theirs[n])
            if not e <= tol:
                problems.append(f"gradient of {n!r} rel. error {e:.3g} vs {what} (> {tol})")
    return "; ".join(problems) or None


def run_tasks(tasks) -> list:
    """Run several ``(module:function, args)`` tasks in one process pool (one spawn for many checks)."""
    out = []
    for target, args in tasks:
        mod, fn = target.split(":")
        out.append(getattr(importlib.import_module(mod), fn)(*args))
    return out


if __name__ == "__main__":
    _child_main(sys.argv[1])
