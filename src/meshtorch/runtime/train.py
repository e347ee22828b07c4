"""``meshtorch train``: train the decoder-only Transformer LM under any mesh and layout.

The default run trains the ``small`` preset on the built-in corpus (CPython's pydoc prose) on a
simulated 4-processor mesh ``data:2,model:2`` with the layout
``batch:data;heads:model;d_ff:model;vocab:model`` (data parallel x Megatron-style model parallel),
shows loss, tokens/s and MFU in a progress bar, reports validation loss in nats and bits per
byte, writes a loss-curve PNG and prints a sample.

Under ``torchrun --nproc-per-node N`` / ``meshtorch launch -n N`` (N = mesh size) every process
holds one processor (:class:`~meshtorch.mesh.spmd.SpmdMeshImpl`): all draw the same batches, each
feeds only its rows of the batch (``feed_slices=True``), every process calls ``save`` (each
writes the slices it owns) and ``restore``; only the main process prints, shows the progress
bar and writes the plot and the tokenizer.
"""

from __future__ import annotations

import math
import os
import time

import torch

from meshtorch.checkpoint import latest_checkpoint, load_manifest, restore, save
from meshtorch.core.errors import CheckpointError, LayoutError, RunFailure, UsageError
from meshtorch.core.mesh_spec import MeshSpec
from meshtorch.data.sharding import local_batch_indices, local_feed
from meshtorch.data.text import ByteTokenizer, PackedDataset, SentencePieceTokenizer, load_documents
from meshtorch.lowering import Lowering
from meshtorch.mesh.factory import make_mesh_impl
from meshtorch.mesh.process import init_distributed
from meshtorch.mesh.recorder import collective_report, flight_recorder
from meshtorch.models.transformer import build_lm, flops_per_token, preset
from meshtorch.optim import (
    AdafactorOptimizer,
    AdamOptimizer,
    AdamWOptimizer,
    MomentumOptimizer,
    SgdOptimizer,
    cosine_decay_with_warmup,
    linear_warmup,
    rsqrt_decay,
)
from meshtorch.optim.schedules import _cosine_decay_with_warmup, _linear_warmup, _rsqrt_decay
from meshtorch.planning.command import parse_bytes
from meshtorch.runtime import checks, runs
from meshtorch.runtime.autolayout import choose_layout
from meshtorch.runtime.calibrate import cached
from meshtorch.runtime.generate import sample
from meshtorch.runtime.metrics import MetricsLog, job_peak_flops, measure_peak_flops, mfu
from meshtorch.runtime.optional import optional_module
from meshtorch.runtime.report import CompileClock, plot_history

DEFAULT_MESH = "data:2,model:2"
DEFAULT_LAYOUT = "batch:data;heads:model;d_ff:model;vocab:model"


def vocab_multiple(mesh_shape: str, layout: str) -> int:
    """The mesh-axis size that splits ``vocab`` under ``layout`` (1 if none)."""
    return MeshSpec(mesh_shape, layout).axis_size_for("vocab")


def make_optimizer(args):
    """The optimizer named by ``--optimizer`` with the ``--schedule`` learning rate."""
    lr = learning_rate(args)
    if args.optimizer == "adamw":
        return AdamWOptimizer(lr, weight_decay=args.weight_decay)
    if args.optimizer == "adam":
        return AdamOptimizer(lr, weight_decay=args.weight_decay)
    if args.optimizer == "adafactor":
        return AdafactorOptimizer(learning_rate=None if args.lr <= 0 else lr)
    if args.optimizer == "momentum":
        return MomentumOptimizer(lr, 0.9)
    return SgdOptimizer(lr)


def learning_rate(args):
    """The ``--schedule`` learning rate: a float or a function of the step."""
    total = max(args.steps, 2)
    peak, warm = args.lr, min(max(args.warmup_steps, 1), total - 1)
    if args.schedule == "constant":
        lr = peak
    elif args.schedule == "linear-warmup":
        lr = lambda step: linear_warmup(step, warm, peak)  # noqa: E731
    elif args.schedule == "rsqrt":
        lr = lambda step: rsqrt_decay(step, warm, peak * math.sqrt(warm))  # noqa: E731
    else:
        lr = lambda step: cosine_decay_with_warmup(step, peak, warm, total)  # noqa: E731
    return lr


def grad_sum_of_squares(graph):
    """The float32 scalar sum of squared gradients that ``--clip-norm`` computes (its square root is the
    global gradient norm before clipping), or None without clipping."""
    return next((op.outputs[0] for op in graph.operations if type(op).__name__ == "GlobalSumOfSquares"), None)


def host_lr(args, step: int) -> float | None:
    """The ``--schedule`` learning rate at ``step`` as a float (the optimizer's graph schedule, on the host),
    for the logs; None for Adafactor's own schedule."""
    if args.optimizer == "adafactor" and args.lr <= 0:
        return None
    total = max(args.steps, 2)
    peak, warm = args.lr, min(max(args.warmup_steps, 1), total - 1)
    s = torch.tensor(float(step), dtype=torch.float64)
    if args.schedule == "constant":
        return peak
    if args.schedule == "linear-warmup":
        return float(_linear_warmup(s, warmup=float(warm), peak=peak))
    if args.schedule == "rsqrt":
        return float(_rsqrt_decay(s, warmup=float(warm), multiplier=peak * math.sqrt(warm)))
    return float(_cosine_decay_with_warmup(s, warmup=float(warm), total=float(total), peak=peak, min_value=0.0))


def batch_feeds(lowering, lm, batch: torch.Tensor) -> dict:
    """``feed_slices=True`` feeds for a token batch int64 ``[batch, length + 1]``: inputs ``batch[:, :-1]``
    and targets ``batch[:, 1:]``, only the rows (and columns) this process's slices hold."""
    feeds = {}
    for t, full in ((lm.inputs, batch[:, :-1]), (lm.targets, batch[:, 1:])):
        rows = full[local_batch_indices(lowering, t)]
        feeds[t] = local_feed(lowering, t, rows)
    return feeds


def evaluate(lowering, lm, dataset, batches: int) -> float:
    """Mean validation cross-entropy (nats per token) over ``batches`` batches (per-process batch slices)."""
    total, n = 0.0, 0
    for b in dataset.batches(lm.config.batch_size, seed=0, split="validation"):
        loss = lm.task_loss if getattr(lm, "task_loss", None) is not None else lm.loss
        total += lowering.run(loss, feeds=batch_feeds(lowering, lm, b), feed_slices=True).item()
        n += 1
        if n >= batches:
            break
    return total / max(n, 1)


def check_args(args) -> runs.RunPaths:
    """Check every ``meshtorch train`` flag before data is loaded or the model built; returns the run's
    name and paths (:func:`meshtorch.runtime.runs.resolve_run`; ``args.checkpoint_dir`` and ``args.plot``
    are set to the resolved paths).

    Raises:
        UsageError: naming the flag (a number out of range, an unwritable output path, a missing
            input file, a mesh size that is not a positive integer, a prompt longer than the context,
            a ``--resume`` with nothing to resume).
        LayoutError: naming a ``--layout``/``--storage`` rule that matches no dimension of the model or no
            axis of the mesh, listing both.
    """
    for flag in ("layers", "d_model", "heads", "d_kv", "d_ff", "length", "batch_size", "steps", "eval_every",
                 "eval_batches", "vocab_size", "keep"):
        checks.positive("--" + flag.replace("_", "-"), getattr(args, flag))
    if args.experts is not None:
        checks.non_negative("--experts", args.experts)
    for flag in ("threads", "warmup_steps", "weight_decay", "clip_norm", "checkpoint_every", "sample", "temperature",
                 "top_k", "bucket_mb"):
        if getattr(args, flag, None) is not None:
            checks.non_negative("--" + flag.replace("_", "-"), getattr(args, flag))
    checks.positive("--peak-tflops", getattr(args, "peak_tflops", None))
    checks.fraction("--dropout", args.dropout)
    if args.optimizer == "adafactor":
        checks.number("--lr", args.lr)  # <= 0: Adafactor's own schedule
    else:
        checks.positive("--lr", args.lr)
    mesh = checks.mesh_shape("--mesh", args.mesh)
    checks.device("--device", getattr(args, "device", None))
    if args.resume and args.checkpoint_dir == "":
        raise UsageError("--resume needs --checkpoint-dir (the directory holding the checkpoints), not ''.")
    if getattr(args, "resume_from", None) and not os.path.isdir(args.resume_from):
        raise UsageError(f"--resume-from {args.resume_from!r} is not a checkpoint directory.")
    paths = runs.resolve_run(args)
    args.checkpoint_dir, args.plot = paths.checkpoint_dir, paths.plot
    if args.resume and not getattr(args, "resume_from", None):
        point = resume_point(args.checkpoint_dir, None) if os.path.isdir(args.checkpoint_dir) else (None,)
        if point[0] is None:  # a damaged newest checkpoint was reported by resume_point, before any work
            raise runs.nothing_to_resume("--resume", args.checkpoint_dir)
    args.data = checks.input_files("--data", args.data)
    runs.check_paths(paths, resuming=bool(args.resume or getattr(args, "resume_from", None)))
    if getattr(args, "log_dir", ""):
        checks.writable_dir("--log-dir", args.log_dir)
        optional_module("tensorboard", "meshtorch train --log-dir")
    if args.sample and not args.prompt:
        raise UsageError("--prompt is empty; sampling needs at least one prompt character (or --sample 0).")
    base = preset(args.preset, num_layers=args.layers, batch_size=args.batch_size)
    pipe = checks.pipeline_fields(args.layout, mesh, getattr(args, "pipeline_stages", None),
                                  getattr(args, "microbatches", None), getattr(args, "pipeline_repeats", None),
                                  base.num_layers, base.batch_size)
    args.pipeline_stages, args.microbatches, args.pipeline_repeats = pipe.values()  # resolved for main_train
    cfg = preset(args.preset, num_layers=max(pipe["pipeline_stages"], 1) * pipe["pipeline_repeats"],
                 d_model=args.d_model, num_heads=args.heads, d_kv=args.d_kv, d_ff=args.d_ff, length=args.length,
                 batch_size=args.batch_size, gated=args.gated or None, vocab_size=256, num_experts=args.experts,
                 **pipe)
    if args.sample and args.tokenizer == "byte" and len(args.prompt.encode("utf-8")) >= cfg.length:
        raise UsageError(f"--prompt is {len(args.prompt.encode('utf-8'))} bytes, but the model's context is "
                         f"{cfg.length} tokens (--length); give a shorter prompt or a longer --length.")
    if args.layout == "auto" or getattr(args, "storage", "") == "auto":
        _choose_layout(args)
    names = checks.graph_dim_names(build_lm(cfg).graph)
    checks.layout_rules("--layout", args.layout, names, mesh)
    checks.layout_rules("--storage", getattr(args, "storage", ""), names, mesh)
    return paths


def _choose_layout(args) -> None:
    """``--layout auto`` / ``--storage auto``: replace them by the layout (and storage rules) the calibrated
    cost model ranks fastest for this model and mesh within ``--memory-limit``
    (:func:`meshtorch.runtime.autolayout.choose_layout`); under torchrun the calibration must be cached
    (every rank reads the same file, so all choose alike).

    Raises:
        UsageError: ``--layout auto`` with explicit ``--storage`` rules that the search cannot keep, under
            torchrun without a cached calibration, or when no layout fits ``--memory-limit``.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    backend = "placement" if world == 1 else ("nccl" if str(getattr(args, "device", "") or "").startswith("cuda")
                                               else "gloo")
    threads = args.threads or torch.get_num_threads()
    if world > 1 and cached(backend, threads) is None:
        raise UsageError(f"--layout auto under torchrun needs this machine's calibration: run 'meshtorch plan "
                         f"--calibrate --backend {backend} --threads {threads}' once first.")
    storage = getattr(args, "storage", "") or ""
    if args.layout != "auto":
        raise UsageError("--storage auto needs --layout auto (the search picks the storage rules together with "
                         "the layout).")
    limit = parse_bytes(args.memory_limit) if getattr(args, "memory_limit", None) else None
    vocab = 256 if args.tokenizer == "byte" else args.vocab_size

    def config(multiple):
        return preset(args.preset, num_layers=args.layers, d_model=args.d_model, num_heads=args.heads,
                      d_kv=args.d_kv, d_ff=args.d_ff, length=args.length, batch_size=args.batch_size,
                      gated=args.gated or None, vocab_size=vocab, vocab_multiple=multiple, num_experts=args.experts)

    say = print if int(os.environ.get("RANK", "0")) == 0 else (lambda *a: None)
    args.layout, chosen_storage = choose_layout(config, args.mesh, storage=storage, memory_limit=limit,
                                                backend=backend, threads=threads, print_fn=say)
    args.storage = chosen_storage if storage in ("", "auto") else storage  # "": storage rules to fit the limit


def _older_hint(older: list[str]) -> str:
    if not older:
        return "there is no older checkpoint; start without --resume"
    return f"older checkpoints: {', '.join(older)}; resume from one with --resume-from {older[0]}"


def resume_point(checkpoint_dir: str, resume_from: str | None):
    """``(path, older)``: the checkpoint to resume from (``resume_from``, or the newest ``ckpt-<step>`` in
    ``checkpoint_dir``; None if there is none) and the older ones.

    Raises:
        CheckpointError: if the newest checkpoint directory has no readable manifest, naming it and the
            older ones to pass to ``--resume-from``.
    """
    if resume_from:
        return resume_from, []
    dirs = checks.step_dirs(checkpoint_dir)
    if not dirs:
        return None, []
    try:
        load_manifest(dirs[0])
    except CheckpointError as e:
        raise CheckpointError(f"--resume: the newest checkpoint {dirs[0]!r} is unreadable ({e}); "
                              f"{_older_hint(dirs[1:])}.") from None
    return dirs[0], dirs[1:]


def main_train(args) -> dict:
    """Run ``meshtorch train`` from its parsed arguments (:mod:`meshtorch.cli.train`); returns the history,
    bits per byte, tokens/s, the lowering, the LM and the sample ids.

    Raises:
        MeshtorchError: if tqdm (the ``meshtorch[cli]`` extra) is not installed.
    """
    tqdm = optional_module("tqdm", "meshtorch train's progress bar").tqdm
    paths = check_args(args)
    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = getattr(args, "device", None)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # under torchrun: join the job before anything prints
        init_distributed(backend=None if device is None else ("nccl" if device.startswith("cuda") else "gloo"))
    impl = make_mesh_impl(args.mesh, args.layout, device=device, storage=getattr(args, "storage", "") or None,
                          async_collectives=getattr(args, "async_collectives", None))
    main_process = impl.is_leader()

    def say(*a):
        if main_process:
            print(*a, flush=True)

    docs = load_documents(args.data)
    fingerprint = runs.data_fingerprint(docs)
    if args.tokenizer == "sentencepiece":
        tok = SentencePieceTokenizer(docs, vocab_size=args.vocab_size)
        if args.checkpoint_dir and main_process:
            tok.save(os.path.join(args.checkpoint_dir, "tokenizer.model"))
    else:
        tok = ByteTokenizer()
    cfg = preset(args.preset, num_layers=args.layers, d_model=args.d_model, num_heads=args.heads, d_kv=args.d_kv,
                 d_ff=args.d_ff, length=args.length, batch_size=args.batch_size, dropout=args.dropout,
                 activation=args.activation, norm=args.norm, gated=args.gated or None, vocab_size=tok.vocab_size,
                 vocab_multiple=vocab_multiple(args.mesh, args.layout), num_experts=args.experts,
                 remat=getattr(args, "remat", None),
                 **{f: getattr(args, f, None) for f in ("pipeline_stages", "microbatches", "pipeline_repeats")})
    if args.sample and len(tok.encode(args.prompt)) >= cfg.length:  # SentencePiece: known once it is trained
        raise UsageError(f"--prompt is {len(tok.encode(args.prompt))} tokens, but the model's context is "
                         f"{cfg.length} tokens (--length); give a shorter prompt or a longer --length.")
    record = runs.run_record(paths, args, cfg.to_dict(), fingerprint, len(docs))
    resuming = _resume_check(args, record) if args.resume or getattr(args, "resume_from", None) else None
    dataset = PackedDataset.from_documents(docs, tok, cfg.length + 1)
    bpt = dataset.bytes_per_token  # bits per byte = nats / ln 2 / (bytes per token)
    lm = build_lm(cfg, seed=args.seed, optimizer=make_optimizer(args), clip_norm=args.clip_norm or None)
    executor = getattr(args, "executor", "codegen")
    try:
        lowering = Lowering(lm.graph, {lm.mesh: impl}, mode=executor,
                            bucket_bytes=int(getattr(args, "bucket_mb", 0.0) * 2 ** 20))
    except LayoutError as e:  # e.g. a dimension size the mesh axis does not divide
        raise LayoutError(f"--layout {args.layout!r}: {e}") from None
    eval_lm, eval_lowering = lm, lowering
    if cfg.dropout > 0:  # evaluate without dropout: a twin graph, weights copied before each evaluation
        eval_lm = build_lm(cfg, seed=args.seed, train=False)
        eval_impl = make_mesh_impl(args.mesh, args.layout, device=device, storage=getattr(args, "storage", "") or None)
        eval_lowering = Lowering(eval_lm.graph, {eval_lm.mesh: eval_impl})
    n_params = sum(v.shape.size for v in lm.graph.trainable_variables)
    say(f"model: {cfg.num_layers} layers, d_model {cfg.d_model}, {cfg.num_heads} heads x d_kv {cfg.d_kv}, "
          f"d_ff {cfg.d_ff}, vocab {cfg.padded_vocab}, {n_params / 1e6:.2f}M parameters; "
          f"batch {cfg.batch_size} x length {cfg.length}")
    say(f"mesh {args.mesh!r} layout {args.layout!r} storage {getattr(args, 'storage', '') or '(as the layout)'!r}; "
        f"{len(dataset.train)} train / "
          f"{len(dataset.validation)} validation sequences")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    gpus = sorted({str(impl.device(p)) for p in impl.local_pnums() if impl.device(p).type == "cuda"})
    if getattr(args, "peak_tflops", None):
        peak, peak_what = args.peak_tflops * 1e12, "--peak-tflops"
    elif gpus:  # the slices live on GPUs: their matmul rate, times the GPUs of the job
        peak = measure_peak_flops(device=gpus[0]) * len(gpus) * world
        peak_what = f"a float32 matmul measured on {gpus[0]}, x {len(gpus) * world} GPU(s)"
    else:
        peak = job_peak_flops(measure_peak_flops(), torch.get_num_threads(),
                              int(os.environ.get("LOCAL_WORLD_SIZE", str(world))), world)
        peak_what = (f"a float32 matmul measured on this process's share of {torch.get_num_threads()} thread(s), "
                     f"x {world} process{'es' if world > 1 else ''}")
    fpt = flops_per_token(cfg)
    metrics = None
    if getattr(args, "log_dir", "") and main_process:
        metrics = MetricsLog(args.log_dir, {"config": cfg.to_dict(), "mesh": args.mesh, "layout": args.layout,
                                            "storage": getattr(args, "storage", ""), "processes": world})
    tokens_per_step = cfg.batch_size * cfg.length
    history = {"step": [], "loss": [], "val_step": [], "val_loss": []}
    sumsq = grad_sum_of_squares(lm.graph)  # the clipping's global norm, if --clip-norm > 0
    fetches = [lm.loss] + ([sumsq] if sumsq is not None else []) + lm.updates
    start, epoch, in_epoch = 0, 0, 0
    if resuming is not None:
        start, epoch, in_epoch = _resume(resuming, lowering, record, history, say)
        paths.name = record["run"]  # the resumed run goes on (its retention covers its earlier checkpoints)
    if args.checkpoint_dir and main_process:
        runs.write_run_manifest(args.checkpoint_dir, record)
        if paths.default_layout:
            runs.point_latest(args.runs_dir, paths.name)
    if args.checkpoint_dir:
        say(f"run {paths.name!r}: checkpoints in {args.checkpoint_dir} (run manifest: "
            f"{os.path.join(args.checkpoint_dir, runs.RUN_MANIFEST)})")
    saved = None
    batches = dataset.stream(cfg.batch_size, args.seed, epoch, in_epoch)
    bar = tqdm(total=args.steps, initial=start, desc="train", dynamic_ncols=True, mininterval=0.5,
               disable=not main_process)
    t_start, first_loss = time.perf_counter(), None
    comp = CompileClock(lowering.session, bar, tqdm.write if main_process else (lambda _m: None))
    trace = None
    if getattr(args, "trace_collectives", False):  # every collective this process runs, for the report below
        trace = flight_recorder().sink = []
    try:
        for step in range(start, args.steps):
            epoch, in_epoch, batch = next(batches)
            comp.before("training step")
            t0 = time.perf_counter()
            outs = lowering.run(fetches, feeds=batch_feeds(lowering, lm, batch), feed_slices=True)
            dt = time.perf_counter() - t0
            comp.after("training step", dt, steps=1)
            loss = outs[0].item()
            gnorm = math.sqrt(outs[1].item()) if sumsq is not None and outs[1].item() >= 0 else None
            if sumsq is not None and not math.isfinite(outs[1].item()):
                gnorm = float("nan")
            first_loss = loss if first_loss is None else first_loss
            what = checks.divergence(loss, first_loss)
            if what is None and gnorm is not None and not math.isfinite(gnorm):
                what = f"the gradient norm is {gnorm}"
            if what:
                raise RunFailure(f"training diverged: {what} at step {step + 1}; nothing after step {step} was "
                                 f"saved. {_last_good(args.checkpoint_dir)} {_advice(args)}")
            history["step"].append(step)
            history["loss"].append(loss)
            tps = tokens_per_step / dt
            peak = max(peak, tps * fpt)  # the start-up measurement was low (a busy machine): never over 100 %
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tps:.0f}", mfu=f"{100 * mfu(tps * fpt, peak):.1f}%")
            if metrics is not None:
                metrics.log(step + 1, loss=loss, bits_per_byte=loss / math.log(2) / bpt,
                            learning_rate=host_lr(args, step), grad_norm=gnorm, tokens_per_s=tps,
                            tokens_per_s_per_process=tps / world, mfu=mfu(tps * fpt, peak))
            if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
                if eval_lowering is not lowering:
                    for name in lowering.variable_names:
                        if name in eval_lowering.variable_names:
                            eval_lowering.set_variable_value(name, lowering.variable_value(name))
                comp.before("evaluation step")
                t0 = time.perf_counter()
                val = evaluate(eval_lowering, eval_lm, dataset, args.eval_batches)
                comp.after("evaluation step", time.perf_counter() - t0, steps=0, session=eval_lowering.session)
                history["val_step"].append(step + 1)
                history["val_loss"].append(val)
                if metrics is not None:
                    metrics.log(step + 1, validation_loss=val, validation_bits_per_byte=val / math.log(2) / bpt)
                if main_process:
                    tqdm.write(f"step {step + 1}: validation loss {val:.4f} nats/token, "
                               f"{val / math.log(2) / bpt:.4f} bits per byte")
            if args.checkpoint_dir and ((args.checkpoint_every and (step + 1) % args.checkpoint_every == 0)
                                        or step + 1 == args.steps):
                _check_finite(lowering, step + 1, args)
                saved = save(lowering, args.checkpoint_dir, step=step + 1, keep=args.keep, run=paths.name,
                             extra={**record, "data": {"epoch": epoch, "batch": in_epoch}, "history": history})
                if main_process:
                    tqdm.write(f"saved checkpoint {saved}")
            bar.update(1)
    finally:
        bar.close()  # an error message starts on its own line
        if trace is not None:
            flight_recorder().sink = None
    if not history["val_loss"] or history["val_step"][-1] <= start:
        raise UsageError(f"--steps {args.steps}: nothing to train, the checkpoint is already at step {start}; "
                         "give a larger --steps to continue.")
    wall = time.perf_counter() - t_start
    steady_steps = args.steps - start - comp.steps  # throughput: steady-state steps only, compiling excluded
    tps = max(steady_steps, 1) * tokens_per_step / max(wall - comp.seconds, 1e-9)
    val = history["val_loss"][-1]
    if metrics is not None:
        metrics.close()
    if comp.seconds:
        say(f"compile seconds: {comp.seconds:.1f} ({comp.describe()}); excluded from tokens/s and MFU below")
    say(f"done: {args.steps - start} steps in {wall:.1f} s, {tps:.0f} tokens/s ({tps / world:.0f} per process, "
        f"{world} process{'es' if world > 1 else ''}), MFU {100 * mfu(tps * fpt, peak):.2f}% (of {peak / 1e9:.1f} "
        f"GFLOP/s: {peak_what})")
    say(f"validation: {val:.4f} nats/token, {val / math.log(2) / bpt:.4f} bits per byte")
    say(lowering.counters.summary(detail=getattr(args, "comm_detail", False),
                                  header=f"mesh {args.mesh!r}, layout {args.layout!r}, storage "
                                         f"{getattr(args, 'storage', '') or '(none: as the layout)'!r}"))
    if trace is not None:
        say(collective_report(trace, top=5))
    if saved:
        how = "meshtorch sample" if paths.default_layout else f"meshtorch sample --checkpoint-dir {args.checkpoint_dir}"
        say(f"checkpoint: {saved} (decode it: {how}; continue it: meshtorch train --resume"
            f"{'' if paths.default_layout else ' --checkpoint-dir ' + args.checkpoint_dir} --steps N)")
    if args.plot and main_process:
        plot_history(history, args.plot, bpt, title=f"{cfg.num_layers} layers x d_model {cfg.d_model}; mesh "
              f"{args.mesh or '(1 processor)'}; layout {args.layout or '(replicated)'}"
              + (f"; storage {args.storage}" if getattr(args, "storage", "") else ""))
        say(f"loss curve: {args.plot}")
    ids = None
    if args.sample:  # every process decodes (the logits fetch gathers full tensors); the main one prints
        ids = sample(eval_lowering, eval_lm, tok.encode(args.prompt), max_new_tokens=args.sample,
                     temperature=args.temperature, top_k=args.top_k, seed=args.seed)[0]
        say("sample:\n" + args.prompt + tok.decode(ids))
    return {"history": history, "val_bits_per_byte": val / math.log(2) / bpt, "tokens_per_s": tps,
            "lowering": lowering, "lm": lm, "sample_ids": ids}


def _resume_check(args, record: dict) -> tuple:
    """The checkpoint ``--resume`` / ``--resume-from`` names, checked against this run's model and data before
    the model is built: ``(path, older checkpoints, its extra, whether --force-data applies)``.

    Raises:
        UsageError: naming ``--resume`` and the differing field, if the checkpoint's model config or tokenizer
            differ, or its data fingerprint differs without ``--force-data``; or nothing to resume.
    """
    flag = "--resume-from" if getattr(args, "resume_from", None) else "--resume"
    point, older = resume_point(args.checkpoint_dir, getattr(args, "resume_from", None))
    if point is None:
        raise runs.nothing_to_resume(flag, args.checkpoint_dir)
    saved = load_manifest(point).get("extra") or {}
    bad = runs.resume_mismatch(saved, record)
    force = bad is not None and bad[0] == "data" and getattr(args, "force_data", False)
    if bad is not None and not force:
        raise UsageError(f"{flag} {point}: {bad[1]}.")
    return point, older, saved, force


def _resume(checked: tuple, lowering, record: dict, history: dict, say) -> tuple[int, int, int]:
    """Restore the checkpoint :func:`_resume_check` chose; returns ``(step, epoch, batch in epoch)`` (the data
    position starts over with ``--force-data``) and fills ``history`` (the loss curve so far) and
    ``record["run"]`` (the resumed run's name).

    Raises:
        CheckpointError: naming the checkpoint (and older ones) if it cannot be restored.
    """
    point, older, saved, force = checked
    try:
        meta = restore(lowering, point)
    except CheckpointError as e:
        raise CheckpointError(f"{e} ({_older_hint(older)})") from None
    pos = {} if force else saved.get("data", {})
    start, epoch, in_epoch = meta["step"], pos.get("epoch", 0), pos.get("batch", 0)
    record["run"] = saved.get("run") or record["run"]
    for k, v in (saved.get("history") or {}).items():
        if k in history:
            history[k].extend(v)
    say(f"resumed from {meta['path']} at step {start} (epoch {epoch}, batch {in_epoch})"
        + (": --force-data, the data position starts over on the new data" if force else ""))
    return start, epoch, in_epoch


def _last_good(checkpoint_dir: str) -> str:
    if not checkpoint_dir:
        return "(No --checkpoint-dir.)"
    latest = latest_checkpoint(checkpoint_dir)
    return f"The last good checkpoint is {latest}." if latest else f"No checkpoint in {checkpoint_dir!r} yet."


def _advice(args) -> str:
    return f"Lower --lr (now {args.lr})" + (" or set --clip-norm." if not args.clip_norm else ".")


def _check_finite(lowering, step: int, args) -> None:
    """Refuse to save non-finite weights over a good checkpoint (a gradient that blew up this step)."""
    for name in lowering.variable_names:
        v = lowering.variable_value(name)
        if v.is_floating_point() and not bool(torch.isfinite(v).all()):
            raise RunFailure(f"training diverged: variable {name!r} is not finite after step {step}; not saved. "
                             f"{_last_good(args.checkpoint_dir)} {_advice(args)}")
