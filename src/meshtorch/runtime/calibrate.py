"""Calibration: measure what the cost model needs on the machine a plan is for, and cache it.

:func:`calibrate` measures, with the real kernels and the real collectives of a backend,

* the float32 GEMM rate (``torch.mm`` on the shape classes of a Transformer step, median of the classes'
  best rates) with the given torch thread count, in each of the backend's processes at once (on gloo the
  processes share the host's cores, caches and memory bandwidth, as they do in a job);
* the seconds per kernel call of a planned step (a chain of small elementwise ops run by the default
  codegen executor: dispatch, slot handling and the kernel itself);
* each collective's latency and seconds per wire byte (all-reduce, all-gather, reduce-scatter,
  all-to-all over 2 processors, at 4 KiB and 4 MiB per processor): on the ``placement`` backend
  (one process) or ``gloo`` (2 spawned processes over loopback; ``nccl`` the same way on 2 GPUs);

and returns a :class:`Calibration` whose :meth:`Calibration.cost_model` feeds
:func:`meshtorch.planning.cost.estimate_time` (``serial`` for the placement backend, whose processors run
one after another). Results are cached as JSON per host, backend and thread count under
``$MESHTORCH_CACHE_DIR`` (default ``~/.cache/meshtorch``), so the measurement runs once (tens of
seconds on 2 cores). Source: the alpha-beta model of collectives (Thakur et al. 2005) fitted per
backend, as Alpa and Galvatron profile their clusters before searching.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from meshtorch.core.dims import Dimension
from meshtorch.core.errors import UsageError
from meshtorch.core.graph import Graph, Mesh
from meshtorch.core.mesh_spec import MeshSpec
from meshtorch.lowering import Lowering
from meshtorch.lowering.collectives import KINDS as COLLECTIVE_KINDS
from meshtorch.mesh.factory import make_mesh_impl, placement_mesh_impl
from meshtorch.ops.variables import placeholder
from meshtorch.planning.cost import CostModel, _wire
from meshtorch.runtime.plan_command import main_plan

BACKENDS = ("placement", "gloo", "nccl")
KINDS = tuple(k for k, c in COLLECTIVE_KINDS.items() if c.calibrate is not None)  # the kinds measured
_SIZES = (1024, 1024 * 1024)  # float32 elements per processor: 4 KiB and 4 MiB
_GEMMS = ((2048, 128, 512), (2048, 512, 128), (2048, 128, 128), (512, 512, 512), (2048, 128, 1024))
# the class each low-precision dtype's rate is measured on, as a ratio to float32's on it (small: a CPU
# without bf16 instructions runs bfloat16 GEMMs some 30x slower than float32)
_DTYPE_GEMM = (128, 128, 512)
_LOW_DTYPES = (torch.bfloat16, torch.float16)


@dataclass
class Calibration:
    """What :func:`calibrate` measured (seconds, FLOP/s, seconds per byte).

    Attributes:
        host, backend, threads: what it was measured on (the cache key).
        gemm_flop_rate: median over the GEMM shape classes of each class's best float32 rate, FLOP/s.
        gemm_rates: ``{"m x k x n": FLOP/s}`` per class.
        kernel_overhead: seconds per kernel call of a planned step.
        memory_bandwidth: bytes read and written per second by a mix of a Transformer step's elementwise kernels
            (``_ELEMENTWISE``: multiply, add, exp, softmax, relu on ``_ELEMENTWISE_SIZE`` floats; their total bytes
            over their total seconds), the rate :func:`~meshtorch.planning.cost.estimate_time` prices the slicewise
            steps' reads and writes at.
        version: the measuring method (``CALIBRATION_VERSION`` when measured by this meshtorch; an older cached
            calibration is measured again).
        collectives: ``{kind: [latency_s, seconds_per_wire_byte]}`` over 2 processors.
        measured_s: how long the measurement took; ``when``: its UTC time.
        spread: ``{"gemm", "kernel", "elementwise": (max - min) / median}`` of the compute measurements over
            ``REPEATS`` repetitions (each a best of several rounds; the constants are their medians).
        dtype_rates: ``{"bfloat16": FLOP/s, "float16": FLOP/s}``: ``gemm_flop_rate`` times the rate of that dtype
            over float32's on one shape class (``_DTYPE_GEMM``), the compute dtype of ``--precision bf16/fp16``.
        load: the host's 1-minute load average when the measurement started (``os.getloadavg``), and
            ``busy``: whether other work competed (a load above the host's cores, or a spread over
            ``BUSY_SPREAD``): the constants may then be off, and the ranking less trustworthy.
    """

    host: str
    backend: str
    threads: int
    gemm_flop_rate: float
    kernel_overhead: float
    collectives: dict = field(default_factory=dict)
    memory_bandwidth: float = 0.0
    gemm_rates: dict = field(default_factory=dict)
    measured_s: float = 0.0
    when: str = ""
    spread: dict = field(default_factory=dict)
    load: float = 0.0
    busy: bool = False
    dtype_rates: dict = field(default_factory=dict)
    version: int = 1

    def trust(self) -> str:
        """How far the constants can be trusted, a few words: the largest spread and whether the host was busy."""
        worst = max(self.spread.values(), default=None)
        what = "spread not measured" if worst is None else f"spread {100 * worst:.0f}% over {REPEATS} repetitions"
        return what + (f", host busy (load {self.load:.1f} on {os.cpu_count()} cores)" if self.busy else "")

    def cost_model(self, processes: int | None = None) -> CostModel:
        """The :class:`~meshtorch.planning.cost.CostModel` of these measurements (``serial`` on placement);
        ``processes``: the job's process count on a gloo/nccl backend, when more processes than this host's cores
        time-share them (:meth:`~meshtorch.planning.cost.CostModel.sharing_cores`; the constants were measured in
        2 processes side by side)."""
        coll = tuple((k, float(a), float(b)) for k, (a, b) in sorted(self.collectives.items()))
        ar = self.collectives.get("allreduce", (5e-5, 1e-10))
        rates = (("float32", float(self.gemm_flop_rate)),) + tuple(sorted(self.dtype_rates.items()))
        model = CostModel(flop_rate=self.gemm_flop_rate, bandwidth=1.0 / max(ar[1], 1e-15), latency=ar[0],
                          kernel_overhead=self.kernel_overhead, memory_bandwidth=self.memory_bandwidth,
                          serial=self.backend == "placement", flop_rates=rates,
                          spread=max(self.spread.values(), default=None), busy=self.busy,
                          collectives=coll, name=f"calibrated {self.backend}, {self.threads} thread(s), {self.host} "
                                                 f"({self.trust()})")
        if processes is None or self.backend == "placement":
            return model
        return model.sharing_cores(processes * self.threads, usable_cores(), measured_with=2 * self.threads)

    def summary(self) -> str:
        """What was measured, a few lines for a person."""
        lines = [f"calibration of {self.host}, backend {self.backend}, {self.threads} torch thread(s) "
                 f"({self.when}, {self.measured_s:.1f} s):",
                 f"  float32 GEMM {self.gemm_flop_rate / 1e9:.1f} GFLOP/s (median of "
                 + ", ".join(f"{k}: {v / 1e9:.0f}" for k, v in self.gemm_rates.items()) + ")"
                 + "".join(f", {k} {v / 1e9:.2f} GFLOP/s" for k, v in self.dtype_rates.items()),
                 f"  {self.kernel_overhead * 1e6:.1f} us per kernel call of a planned step, elementwise "
                 f"{self.memory_bandwidth / 1e9:.1f} GB/s",
                 f"  {self.trust()}" + ("; measure again on a quiet host (meshtorch plan --calibrate)"
                                        if self.busy else "")]
        for k, (a, b) in self.collectives.items():
            lines.append(f"  {k:<15} latency {a * 1e6:8.1f} us, {1 / max(b, 1e-15) / 1e9:6.2f} GB/s on the wire")
        return "\n".join(lines)


def cache_path(backend: str, threads: int) -> str:
    """The JSON file a calibration of ``backend`` with ``threads`` torch threads on this host is cached in."""
    root = os.environ.get("MESHTORCH_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "meshtorch")
    return os.path.join(root, "calibration", f"{_host_key()}-{backend}-t{threads}.json")


def cached(backend: str = "placement", threads: int | None = None) -> Calibration | None:
    """The cached calibration for this host, ``backend`` and thread count, or None."""
    threads = threads or torch.get_num_threads()
    try:
        with open(cache_path(backend, threads)) as f:
            cal = Calibration(**json.load(f))
    except (OSError, ValueError, TypeError):
        return None
    return cal if cal.version == CALIBRATION_VERSION else None  # older constants mean other things: measure


def calibrate(backend: str = "placement", threads: int | None = None, force: bool = False) -> Calibration:
    """Measure (or read from the cache) what the cost model needs on this machine.

    Args:
        backend: ``"placement"`` (one process), ``"gloo"`` or ``"nccl"`` (2 spawned processes).
        threads: torch intra-op threads to measure with (default: this process's).
        force: measure even if a cached calibration exists (and replace it).

    Raises:
        UsageError: an unknown backend, or ``nccl`` without 2 CUDA devices.
    """
    if backend not in BACKENDS:
        raise UsageError(f"calibrate: backend must be one of {', '.join(BACKENDS)}, got {backend!r}.")
    if backend == "nccl" and torch.cuda.device_count() < 2:
        raise UsageError("calibrate: backend 'nccl' needs 2 CUDA devices; this machine has "
                         f"{torch.cuda.device_count()}.")
    threads = threads or torch.get_num_threads()
    if not force:
        hit = cached(backend, threads)
        if hit is not None:
            return hit
    t0 = time.perf_counter()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        if backend == "placement":
            rates, overhead, bandwidth, spread, low = _compute_rates()
            coll = _placement_collectives()
        else:  # measured in the 2 processes, side by side: they share the host's cores, caches and memory
            rates, overhead, bandwidth, spread, low, coll = _spawned(backend, threads)
    finally:
        torch.set_num_threads(old)
    cal = Calibration(host=_host_key(), backend=backend, threads=threads,
                      gemm_flop_rate=statistics.median(rates.values()), kernel_overhead=overhead,
                      collectives=coll, gemm_rates=rates, memory_bandwidth=bandwidth,
                      measured_s=time.perf_counter() - t0, spread=spread, load=load,
                      busy=_busy(load, spread), dtype_rates=low, version=CALIBRATION_VERSION,
                      when=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))
    path = cache_path(backend, threads)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(asdict(cal), f, indent=1)
    os.replace(tmp, path)
    return cal


def usable_cores() -> int:
    """The CPU cores this process may run on (``os.sched_getaffinity``; ``os.cpu_count()`` where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _host_key() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    key = f"{socket.gethostname()}-{cpu}-{os.cpu_count()}cores"
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in key)[:120]


def _best_seconds(fn, reps: int = 5, min_s: float = 0.02, calls: int | None = None) -> float:
    """Best per-call seconds of ``fn`` over ``reps`` rounds of at least ``min_s`` each (after a warm-up);
    ``calls``: a fixed number of calls per round instead (every rank of a collective must call alike)."""
    fn()
    best = float("inf")
    for _ in range(reps):
        n, t0 = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            dt = time.perf_counter() - t0
            if (calls is not None and n >= calls) or (calls is None and dt >= min_s):
                break
        best = min(best, dt / n)
    return best


CALIBRATION_VERSION = 2  # 2: memory_bandwidth of the elementwise mix, priced on bytes read and written
_ELEMENTWISE_SIZE = 1 << 18  # floats: a Transformer activation slice (batch x length x d_model of the small preset)
# the elementwise mix: (kernel on operands a, b; tensors it reads and writes)
_ELEMENTWISE = ((lambda a, b: a * b, 3), (lambda a, b: a + b, 3), (lambda a, b: torch.exp(a), 2),
                (lambda a, b: torch.softmax(a.view(-1, 256), -1), 2), (lambda a, b: torch.relu(a), 2))
REPEATS = 3  # repetitions of the compute measurements; the constants are their medians
BUSY_SPREAD = 0.15  # a larger spread between repetitions: the host was busy


def _compute_rates() -> tuple[dict, float, float, dict, dict]:
    """``(GEMM FLOP/s per shape class, seconds per kernel call, elementwise bytes/s, spread, low-precision
    FLOP/s per dtype)`` in this process: each the median of ``REPEATS`` repetitions (each a best of several
    rounds), and the spread ``(max - min) / median`` of the GEMM rate (the median over the classes), the
    kernel call and the elementwise bandwidth over the repetitions. A low-precision dtype's rate is the float32
    median times its rate over float32's on ``_DTYPE_GEMM``."""
    big = [torch.randn(_ELEMENTWISE_SIZE), torch.randn(_ELEMENTWISE_SIZE)]
    runs = []
    for _ in range(REPEATS):
        rates = {f"{m}x{k}x{n}": _gemm_rate(m, k, n) for m, k, n in _GEMMS}
        bandwidth = _elementwise_bandwidth(big)
        ref = _gemm_rate(*_DTYPE_GEMM, reps=3)
        ratios = {str(d).replace("torch.", ""): _gemm_rate(*_DTYPE_GEMM, dtype=d, reps=3) / ref for d in _LOW_DTYPES}
        runs.append((rates, _kernel_overhead(), bandwidth, ratios))
    rates = {k: statistics.median(r[0][k] for r in runs) for k in runs[0][0]}
    series = {"gemm": [statistics.median(r[0].values()) for r in runs], "kernel": [r[1] for r in runs],
              "elementwise": [r[2] for r in runs]}
    spread = {k: (max(v) - min(v)) / statistics.median(v) for k, v in series.items()}
    low = {k: statistics.median(rates.values()) * statistics.median(r[3][k] for r in runs) for k in runs[0][3]}
    return rates, statistics.median(series["kernel"]), statistics.median(series["elementwise"]), spread, low


def _elementwise_bandwidth(x: list) -> float:
    """Bytes read and written per second by the ``_ELEMENTWISE`` kernels on the two float32 tensors ``x`` (their
    total bytes over their total best seconds: a step's elementwise work is such a mix, and one multiply streams
    some 10x faster per byte than an exp or a softmax on this size)."""
    total_bytes = total_s = 0.0
    for fn, tensors in _ELEMENTWISE:
        total_bytes += tensors * x[0].numel() * x[0].element_size()
        total_s += _best_seconds(lambda fn=fn: fn(*x), reps=5, min_s=0.02)
    return total_bytes / total_s


def _busy(load: float, spread: dict) -> bool:
    """Whether other work competed with the measurement: a 1-minute load average (this process included) above
    the host's cores, or a spread between repetitions over ``BUSY_SPREAD``."""
    return load > (os.cpu_count() or 1) or max(spread.values(), default=0.0) > BUSY_SPREAD


def _gemm_rate(m: int, k: int, n: int, dtype=torch.float32, reps: int = 5) -> float:
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    return 2 * m * k * n / _best_seconds(lambda: a @ b, reps=reps)


def _kernel_overhead(n_ops: int = 200) -> float:
    """Seconds per step of a planned chain of ``n_ops`` elementwise ops on 16-element slices (codegen)."""
    graph = Graph(seed=0)
    mesh = Mesh(graph, "calibration")
    x = placeholder(mesh, "x", [Dimension("d", 16)])
    y = x
    for _ in range(n_ops):
        y = y * 1.0001
    lw = Lowering(graph, {mesh: placement_mesh_impl("")})
    feed = {x: torch.ones(16)}
    return _best_seconds(lambda: lw.run(y, feeds=feed), reps=5, min_s=0.05) / n_ops


def _fit(times: dict, kind: str) -> list:
    """``[latency_s, seconds_per_wire_byte]`` through the two measured sizes (group of 2)."""
    (b0, t0), (b1, t1) = sorted(times.items())
    w0, w1 = _wire(kind, b0, 2), _wire(kind, b1, 2)
    per_byte = max((t1 - t0) / (w1 - w0), 1e-15)
    return [max(t0 - per_byte * w0, 0.0), per_byte]


def _run_collective(impl, kind: str, x):
    """The backend's primitive of ``kind`` on ``x`` over mesh axis 0 (primitive and arguments: the kind's record,
    :mod:`meshtorch.lowering.collectives`)."""
    c = COLLECTIVE_KINDS[kind]
    return getattr(impl, c.method)(x, **c.calibrate)


def _placement_collectives() -> dict:
    impl = placement_mesh_impl("all:2")
    out = {}
    for kind in KINDS:
        times = {}
        for n in _SIZES:
            x = [torch.randn(n), torch.randn(n)]
            times[4 * n] = _best_seconds(lambda x=x: _run_collective(impl, kind, x))
        out[kind] = _fit(times, kind)
    return out


def _spmd_worker(rank: int, port: int, backend: str, threads: int, path: str):
    torch.set_num_threads(threads)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        impl = make_mesh_impl("all:2", "", device=f"cuda:{rank}" if backend == "nccl" else "cpu",
                              async_collectives=False)
        dist.barrier()
        compute = _compute_rates()  # both ranks at once, as in a job
        out = {}
        for kind in KINDS:
            times = {}
            for n in _SIZES:
                x = torch.randn(n, device=impl.device(rank))

                def once(x=x, kind=kind):
                    dist.barrier()
                    r = _run_collective(impl, kind, x)
                    if backend == "nccl":
                        torch.cuda.synchronize()
                    return r
                barrier = _best_seconds(dist.barrier, reps=3, calls=10)
                times[4 * n] = max(_best_seconds(once, reps=3, calls=10) - barrier, 1e-7)
            out[kind] = _fit(times, kind)
        if rank == 0:
            with open(path, "w") as f:
                json.dump({"compute": compute, "collectives": out}, f)
    finally:
        dist.destroy_process_group()


def _spawned(backend: str, threads: int) -> tuple[dict, float, float, dict, dict, dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = os.path.join(os.path.dirname(cache_path(backend, threads)), f"spawn-{os.getpid()}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    for attempt in range(2):  # a gloo rendezvous on loopback can fail once (a port taken meanwhile): try again
        try:
            mp.start_processes(_spmd_worker, args=(port + attempt, backend, threads, path), nprocs=2,
                               start_method="spawn")
            break
        except (mp.ProcessExitedException, mp.ProcessRaisedException):
            if attempt:
                raise
    with open(path) as f:
        out = json.load(f)
    os.remove(path)
    rates, overhead, bandwidth, spread, low = out["compute"]
    return rates, overhead, bandwidth, spread, low, out["collectives"]


def run_plan(args):
    """``meshtorch plan``: with ``--calibrate`` measure this machine first (and cache it); with ``--hardware
    calibrated`` use the cached calibration of ``--backend``/``--threads`` (measuring it if there is none),
    with ``auto`` use it only if cached; then :func:`meshtorch.runtime.plan_command.main_plan`.

    Raises:
        UsageError: ``--threads`` < 1, or a backend this machine cannot measure (``nccl`` without 2 GPUs).
    """
    if args.threads < 1:
        raise UsageError(f"--threads must be >= 1, got {args.threads}.")
    cal = None
    if args.calibrate or args.hardware == "calibrated":
        cal = calibrate(args.backend, args.threads, force=args.calibrate)
        print(cal.summary())
    elif args.hardware == "auto":
        cal = cached(args.backend, args.threads)
    if cal is not None:  # gloo/nccl: one process per processor of --mesh
        procs = MeshSpec(args.mesh).size if args.backend != "placement" and getattr(args, "mesh", None) else None
        args.cost_model = cal.cost_model(processes=procs)
    return main_plan(args)
