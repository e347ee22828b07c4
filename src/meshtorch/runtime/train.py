"""``meshtorch train``: train the decoder-only Transformer LM under any mesh and layout.

The default run trains the ``small`` preset on the built-in corpus (CPython's pydoc prose) on a
simulated 4-processor mesh ``data:2,model:2`` with the layout
``batch:data;heads:model;d_ff:model;vocab:model`` (data parallel x Megatron-style model parallel),
shows loss, tokens/s and MFU in a progress bar, reports validation loss in nats and bits per
byte, writes a loss-curve PNG and prints a sample.

Under ``torchrun --nproc-per-node N`` / ``meshtorch launch -n N`` (N = mesh size; with neither
``--mesh`` nor ``--layout`` the job is data parallel, mesh ``data:N`` and layout ``batch:data``,
:func:`~meshtorch.runtime.train_config.default_mesh_layout`) every process holds one processor
(:class:`~meshtorch.mesh.spmd.SpmdMeshImpl`): all draw the same batches, each feeds only its rows of
the batch (``feed_slices=True``), every process calls ``save`` (each writes the slices it owns) and
``restore``; only the main process prints, shows the progress bar and writes the plot and the
tokenizer.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from meshtorch.checkpoint import hf, latest_checkpoint, load_manifest, restore, save
from meshtorch.core.errors import CheckpointError, LayoutError, RunFailure, UsageError
from meshtorch.data.pairs import PairsDataset
from meshtorch.data.sharding import local_batch_indices, local_feed
from meshtorch.data.text import ByteTokenizer, PackedDataset, SentencePieceTokenizer, load_documents
from meshtorch.lowering import Lowering
from meshtorch.mesh.factory import make_mesh_impl
from meshtorch.mesh.process import init_distributed
from meshtorch.mesh.recorder import collective_report, flight_recorder
from meshtorch.models.hf import hf_flops_per_token
from meshtorch.models.hf_config import HFModelConfig
from meshtorch.models.transformer import build_lm, flops_per_token, preset
from meshtorch.optim.accumulate import ACCUMULATOR_SUFFIX, build_training_graph
from meshtorch.optim.base import GLOBAL_STEP_NAME
from meshtorch.optim.loss_scale import LOSS_SCALE_VARIABLES
from meshtorch.optim.schedules import _cosine_decay_with_warmup, _linear_warmup, _rsqrt_decay
from meshtorch.runtime import checks, failures, hf_train, pipeline_train, runs
from meshtorch.runtime.generate import sample
from meshtorch.runtime.metrics import MetricsLog, job_peak_flops, measure_peak_flops, mfu
from meshtorch.runtime.optimizers import make_optimizer
from meshtorch.runtime.optional import optional_module
from meshtorch.runtime.report import CompileClock, plot_history
from meshtorch.runtime.train_config import TrainConfig, older_hint, resume_point, vocab_multiple, world_size


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
    and targets ``batch[:, 1:]``, only the rows (and columns) this process's slices hold; a T5 model's batch is
    :class:`~meshtorch.data.pairs.PairsDataset`'s ``[batch, 2 * length]``: inputs ``| targets``."""
    feeds, n = {}, batch.shape[1] // 2
    halves = ((batch[:, :n], batch[:, n:]) if getattr(lm, "encoder_decoder", False)
              else (batch[:, :-1], batch[:, 1:]))
    for t, full in zip((lm.inputs, lm.targets), halves, strict=True):
        rows = full[local_batch_indices(lowering, t)]
        feeds[t] = local_feed(lowering, t, rows)
    return feeds


def evaluate(lowering, lm, dataset, batches: int, microbatches: int = 1) -> float:
    """Mean validation cross-entropy (nats per token) over ``batches`` batches (per-process batch slices).

    ``microbatches`` N > 1 (``--accumulate``): ``lm`` is built for a microbatch; each batch of N microbatches is
    evaluated as N runs, so the same validation rows are read as without accumulation."""
    total, n = 0.0, 0
    loss = lm.task_loss if getattr(lm, "task_loss", None) is not None else lm.loss
    micro = lm.config.batch_size
    for b in dataset.batches(micro * microbatches, seed=0, split="validation"):
        total += sum(lowering.run(loss, feeds=batch_feeds(lowering, lm, b[k * micro:(k + 1) * micro]),
                                  feed_slices=True).item() for k in range(microbatches)) / microbatches
        n += 1
        if n >= batches:
            break
    return total / max(n, 1)


@dataclass
class _Job:
    """What the steps of :func:`main_train` build and share: the checked config, the run's paths and record,
    the mesh, the data, the model and its lowerings (and the twin without dropout for evaluation)."""

    cfg: TrainConfig
    paths: runs.RunPaths
    impl: object
    say: Callable
    tok: object = None
    dataset: PackedDataset | None = None
    model: object = None  # the LM's config (meshtorch.models.transformer.LMConfig)
    record: dict = field(default_factory=dict)
    lm: object = None
    lowering: Lowering | None = None
    eval_lm: object = None
    eval_lowering: Lowering | None = None
    trace: list | None = None  # --trace-collectives: the flight recorder's records of the training steps
    accumulation: object = None  # --accumulate N > 1: the AccumulatedUpdates of the microbatch graph
    pipeline: object = None  # --pipeline-schedule 1f1b etc.: the PipelineTrainer (runtime.pipeline_train)

    @property
    def main_process(self) -> bool:
        return self.impl.is_leader()


def main_train(args) -> dict:
    """Run ``meshtorch train`` from its parsed arguments (:mod:`meshtorch.cli.train`; an argparse Namespace or
    a :class:`~meshtorch.runtime.train_config.TrainConfig`); returns the history, bits per byte, tokens/s, the
    lowering, the LM and the sample ids.

    Steps: check the config (:meth:`TrainConfig.checked`), join the mesh, read and tokenize the data, build
    the model and its lowering, resume, train (evaluating and saving on the way), report and sample.

    Raises:
        MeshtorchError: if tqdm (the ``meshtorch[cli]`` extra) is not installed.
    """
    tqdm = optional_module("tqdm", "meshtorch train's progress bar").tqdm
    cfg, paths = TrainConfig.from_args(args).checked()
    job = _start(cfg, paths)
    resuming = _load_data(job)
    _build_model(job)
    peak, peak_what = _peak_flops(job)
    history, start, peak, saved, wall, comp = _train_loop(job, resuming, peak, tqdm)
    if job.pipeline is not None and cfg.pipeline_trace:  # every rank: rank 0 gathers and writes
        job.say(job.pipeline.write_trace(cfg.pipeline_trace))
    return _report(job, history, start, peak, peak_what, saved, wall, comp)


def _start(cfg: TrainConfig, paths: runs.RunPaths) -> _Job:
    """Seed, threads, the torchrun job (joined before anything prints) and the mesh implementation."""
    torch.manual_seed(cfg.seed)
    cfg.precision_policy.set_matmul_precision()  # every process (torchrun rank), before any step is compiled
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = cfg.device
    if world_size() > 1:  # under torchrun: join the job before anything prints
        init_distributed(backend=None if device is None else ("nccl" if device.startswith("cuda") else "gloo"))
    impl = make_mesh_impl(cfg.mesh, cfg.layout, device=device, storage=cfg.storage or None,
                          async_collectives=cfg.async_collectives)
    main_process = impl.is_leader()

    def say(*a):
        if main_process:
            print(*a, flush=True)

    return _Job(cfg, paths, impl, say)


def _load_data(job: _Job) -> tuple | None:
    """Documents, tokenizer, the model's config (a native preset's LMConfig, or with ``--init-from`` the
    imported model's HFModelConfig) and the packed dataset; the run's record, and the checkpoint to resume
    checked against it (None: a new run)."""
    cfg = job.cfg
    pairs = hf_train.t5_pairs(cfg)  # a T5 run's input/target pairs (None: a decoder-only or native run)
    t5 = pairs is not None
    docs = ["\n".join(a + "\t" + b for a, b, _ in pairs)] if t5 else load_documents(
        list(cfg.data) if cfg.data is not None else None)
    fingerprint = runs.data_fingerprint(docs)
    multiple = vocab_multiple(cfg.mesh, cfg.layout)
    if cfg.init_from:  # the model and its tokenizer come from the Hugging Face directory (or the resumed run)
        model = hf_train.model_config(cfg, multiple, cfg.saved_record())
        tok = hf_train.tokenizer(cfg, model)
        if job.main_process:
            hf_train.save_tokenizer(tok, cfg.checkpoint_dir)
        extra = {"preset": None, "tokenizer": "byte" if cfg.tokenizer == "byte" else hf_train.TOKENIZER,
                 **hf_train.record_fields(cfg, model)}
    else:
        if cfg.tokenizer == "sentencepiece":
            tok = SentencePieceTokenizer(docs, vocab_size=cfg.vocab_size)
            if cfg.checkpoint_dir and job.main_process:
                tok.save(os.path.join(cfg.checkpoint_dir, "tokenizer.model"))
        else:
            tok = ByteTokenizer()
        model = preset(cfg.preset, num_layers=cfg.layers, d_model=cfg.d_model, num_heads=cfg.heads, d_kv=cfg.d_kv,
                       d_ff=cfg.d_ff, length=cfg.length, batch_size=cfg.batch_size, dropout=cfg.dropout,
                       activation=cfg.activation, norm=cfg.norm, gated=cfg.gated or None, vocab_size=tok.vocab_size,
                       vocab_multiple=multiple, num_experts=cfg.experts, remat=cfg.remat, **cfg.pipeline_fields())
        extra = {"preset": cfg.preset}
    if cfg.sample and not t5 and len(tok.encode(cfg.prompt)) >= model.length:  # SentencePiece: known once it is trained
        raise UsageError(f"--prompt is {len(tok.encode(cfg.prompt))} tokens, but the model's context is "
                         f"{model.length} tokens (--length); give a shorter prompt or a longer --length.")
    job.tok, job.model = tok, model
    described = pipeline_train.unpipelined(model) if cfg.pipeline_schedule in pipeline_train.EXECUTED else model
    job.record = {**runs.run_record(job.paths, cfg, described.to_dict(), fingerprint, len(docs)), **extra,
                  "precision": cfg.precision_policy.record()}
    resuming = _resume_check(cfg, job.record) if cfg.resuming else None
    job.dataset = (PairsDataset.from_pairs(pairs, tok, model.length, model.batch_size) if t5
                   else PackedDataset.from_documents(docs, tok, model.length + 1))
    return resuming


def _build_model(job: _Job) -> None:
    """The model with its optimizer, its lowering on the mesh (an imported model's weights read into it, unless
    a checkpoint is resumed), and the twin without dropout for evaluation."""
    cfg, model, n_acc = job.cfg, job.model, job.cfg.accumulate
    opt, clip = make_optimizer(cfg), cfg.clip_norm or None
    kwargs = {"mode": cfg.executor, "bucket_bytes": cfg.bucket_bytes, "compile_backend": cfg.compile_backend}
    imported = isinstance(model, HFModelConfig)
    if cfg.pipeline_schedule in pipeline_train.EXECUTED:  # the stage executor trains, evaluates and checkpoints;
        job.pipeline = pipeline_train.PipelineTrainer(cfg, model)  # lm: the unpipelined graph only (not lowered)
        model = job.pipeline.config
        job.say(job.pipeline.describe())
    try:  # --accumulate N > 1: the graph is one microbatch's; the optimizer is applied once per N of them
        job.lm, job.accumulation = build_training_graph(hf.build if imported else build_lm, model, opt, n_acc, clip,
                                                        seed=cfg.seed, precision=cfg.precision_policy)
        if n_acc > 1:
            model = dataclasses.replace(model, batch_size=model.batch_size // n_acc)  # one microbatch
        if job.pipeline is not None:
            job.lowering = job.pipeline.state  # the stages' variables: what save / restore read and write
            if imported and not cfg.resuming:
                job.pipeline.load_hf(cfg.init_from)
        elif imported and not cfg.resuming:  # an imported model's weights (resumed: from the checkpoint)
            job.lowering = hf.lower_loaded(job.lm, job.impl, cfg.init_from, **kwargs)
        else:
            job.lowering = Lowering(job.lm.graph, {job.lm.mesh: job.impl}, **kwargs)
    except LayoutError as e:  # e.g. a dimension size the mesh axis does not divide
        raise LayoutError(f"--layout {cfg.layout!r}: {e}") from None
    job.eval_lm, job.eval_lowering = job.lm, job.lowering
    if not imported and model.dropout > 0:  # evaluate without dropout: a twin graph, weights copied each time
        job.eval_lm = build_lm(model, seed=cfg.seed, train=False, precision=cfg.precision_policy)
        eval_impl = make_mesh_impl(cfg.mesh, cfg.layout, device=cfg.device, storage=cfg.storage or None)
        job.eval_lowering = Lowering(job.eval_lm.graph, {job.eval_lm.mesh: eval_impl})
    n_params = sum(v.shape.size for v in job.lm.graph.trainable_variables)
    source = f"{model.family} from {cfg.init_from!r}: " if imported else ""
    batch = f"batch {job.model.batch_size}" + (f" ({n_acc} microbatches of {model.batch_size})" if n_acc > 1 else "")
    job.say(f"model: {source}{model.num_layers} layers, d_model {model.d_model}, {model.num_heads} heads x d_kv "
            f"{model.d_kv}, d_ff {model.d_ff}, vocab {model.padded_vocab}, {n_params / 1e6:.2f}M parameters; "
            f"{batch} x length {model.length}; tokenizer {getattr(job.tok, 'path', cfg.tokenizer)}")
    job.say(f"mesh {cfg.mesh!r} layout {cfg.layout!r} storage {cfg.storage or '(as the layout)'!r}; "
            f"{len(job.dataset.train)} train / {len(job.dataset.validation)} validation sequences")


def _flops_per_token(model) -> float:
    """Training FLOPs per token of the native LM or of an imported model."""
    return hf_flops_per_token(model) if isinstance(model, HFModelConfig) else flops_per_token(model)


def _peak_flops(job: _Job) -> tuple[float, str]:
    """The MFU denominator (FLOP/s of the whole job) and where it comes from."""
    impl, world = job.impl, world_size()
    gpus = sorted({str(impl.device(p)) for p in impl.local_pnums() if impl.device(p).type == "cuda"})
    if job.cfg.peak_tflops:
        return job.cfg.peak_tflops * 1e12, "--peak-tflops"
    if gpus:  # the slices live on GPUs: their matmul rate, times the GPUs of the job
        return (measure_peak_flops(device=gpus[0]) * len(gpus) * world,
                f"a float32 matmul measured on {gpus[0]}, x {len(gpus) * world} GPU(s)")
    peak = job_peak_flops(measure_peak_flops(), torch.get_num_threads(),
                          int(os.environ.get("LOCAL_WORLD_SIZE", str(world))), world)
    return peak, (f"a float32 matmul measured on this process's share of {torch.get_num_threads()} thread(s), "
                  f"x {world} process{'es' if world > 1 else ''}")


def _train_loop(job: _Job, resuming, peak: float, tqdm):
    """Resume, then train to ``--steps`` (evaluating every ``--eval-every`` steps and saving every
    ``--checkpoint-every``); returns ``(history, first step, peak, last checkpoint, wall seconds, CompileClock)``.

    Raises:
        RunFailure: the loss or the gradient norm diverged (nothing after the last good step is saved).
    """
    cfg, paths, record, say, main_process = job.cfg, job.paths, job.record, job.say, job.main_process
    lm, lowering, model, world = job.lm, job.lowering, job.model, world_size()
    bpt = job.dataset.bytes_per_token  # bits per byte = nats / ln 2 / (bytes per token)
    fpt = _flops_per_token(model)
    metrics = None
    if cfg.log_dir and main_process:
        metrics = MetricsLog(cfg.log_dir, {"config": model.to_dict(), "mesh": cfg.mesh, "layout": cfg.layout,
                                           "storage": cfg.storage, "processes": world})
    tokens_per_step = model.batch_size * model.length
    history = {"step": [], "loss": [], "val_step": [], "val_loss": []}
    sumsq = grad_sum_of_squares(lm.graph)  # the clipping's global norm, if --clip-norm > 0
    fetches = [lm.loss] + ([sumsq] if sumsq is not None else []) + lm.updates
    n_acc, micro = cfg.accumulate, lm.config.batch_size
    start, epoch, in_epoch = 0, 0, 0
    if resuming is not None:
        start, epoch, in_epoch = _resume(resuming, lowering, record, history, say)
        if job.pipeline is not None:
            job.pipeline.after_restore()
        paths.name = record["run"]  # the resumed run goes on (its retention covers its earlier checkpoints)
    elif cfg.start_step:  # --init-from an exported run: continue at its step and data position
        start, (epoch, in_epoch) = cfg.start_step, job.dataset.position(model.batch_size, cfg.start_step)
        _set_global_step(lowering, start)
        say(f"--start-step {start}: the learning-rate schedule at step {start}, the data at epoch {epoch}, batch "
            f"{in_epoch} (as a run that trained {start} steps)")
    if cfg.checkpoint_dir and main_process:
        runs.write_run_manifest(cfg.checkpoint_dir, record)
        if paths.default_layout:
            runs.point_latest(cfg.runs_dir, paths.name)
    if cfg.checkpoint_dir:
        say(f"run {paths.name!r}: checkpoints in {cfg.checkpoint_dir} (run manifest: "
            f"{os.path.join(cfg.checkpoint_dir, runs.RUN_MANIFEST)})")
    failures.note_run(cfg.checkpoint_dir, paths.name, paths.run_dir if paths.default_layout else cfg.checkpoint_dir)
    saved = None
    batches = job.dataset.stream(model.batch_size, cfg.seed, epoch, in_epoch)
    bar = tqdm(total=cfg.steps, initial=start, desc="train", dynamic_ncols=True, mininterval=0.5,
               disable=not main_process)
    t_start, first_loss = time.perf_counter(), None
    comp = CompileClock(lowering.session, bar, tqdm.write if main_process else (lambda _m: None))
    trace = None
    if cfg.trace_collectives:  # every collective this process runs, for the report
        trace = flight_recorder().sink = []
    try:
        for step in range(start, cfg.steps):
            epoch, in_epoch, batch = next(batches)
            comp.before("training step")
            t0 = time.perf_counter()
            if job.pipeline is not None:  # the schedule's stage executor: [loss, sum of squares] as the fetches
                outs = job.pipeline.step(batch)
                loss = outs[0].item()
            elif n_acc == 1:
                outs = lowering.run(fetches, feeds=batch_feeds(lowering, lm, batch), feed_slices=True)
                loss = outs[0].item()
            else:  # one run per microbatch (its forward and backward), the optimizer with the last
                loss = 0.0
                for k in range(n_acc):
                    rows = batch[k * micro:(k + 1) * micro]
                    fk = fetches if k == n_acc - 1 else [lm.loss] + job.accumulation.fetches(k)
                    outs = lowering.run(fk, feeds=batch_feeds(lowering, lm, rows), feed_slices=True)
                    loss += outs[0].item() / n_acc  # the batch's loss: the mean of equal microbatches' means
            dt = time.perf_counter() - t0
            comp.after("training step", dt, steps=1)
            gnorm = math.sqrt(outs[1].item()) if sumsq is not None and outs[1].item() >= 0 else None
            if sumsq is not None and not math.isfinite(outs[1].item()):
                gnorm = float("nan")
            first_loss = loss if first_loss is None else first_loss
            what = checks.divergence(loss, first_loss)
            if what is None and gnorm is not None and not math.isfinite(gnorm):
                what = f"the gradient norm is {gnorm}"
            if what:
                raise RunFailure(f"training diverged: {what} at step {step + 1}; nothing after step {step} was "
                                 f"saved. {_last_good(cfg.checkpoint_dir)} {_advice(cfg)}")
            history["step"].append(step)
            history["loss"].append(loss)
            tps = tokens_per_step / dt
            peak = max(peak, tps * fpt)  # the start-up measurement was low (a busy machine): never over 100 %
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tps:.0f}", mfu=f"{100 * mfu(tps * fpt, peak):.1f}%")
            if metrics is not None:
                metrics.log(step + 1, loss=loss, bits_per_byte=loss / math.log(2) / bpt,
                            learning_rate=host_lr(cfg, step), grad_norm=gnorm, tokens_per_s=tps,
                            tokens_per_s_per_process=tps / world, mfu=mfu(tps * fpt, peak))
            if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
                val = _evaluate_now(job, comp)
                history["val_step"].append(step + 1)
                history["val_loss"].append(val)
                if metrics is not None:
                    metrics.log(step + 1, validation_loss=val, validation_bits_per_byte=val / math.log(2) / bpt)
                if main_process:
                    tqdm.write(f"step {step + 1}: validation loss {val:.4f} nats/token, "
                               f"{val / math.log(2) / bpt:.4f} bits per byte")
            if cfg.checkpoint_dir and ((cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0)
                                       or step + 1 == cfg.steps):
                _check_finite(lowering, step + 1, cfg)
                saved = save(lowering, cfg.checkpoint_dir, step=step + 1, keep=cfg.keep, run=paths.name,
                             extra={**record, "data": {"epoch": epoch, "batch": in_epoch}, "history": history})
                if main_process:
                    tqdm.write(f"saved checkpoint {saved}")
            bar.update(1)
            failures.inject_fault(step + 1)  # test hook: $MESHTORCH_FAULT (issue 35)
    finally:
        bar.close()  # an error message starts on its own line
        if trace is not None:
            flight_recorder().sink = None
    if not history["val_loss"] or history["val_step"][-1] <= start:
        raise UsageError(f"--steps {cfg.steps}: nothing to train, the checkpoint is already at step {start}; "
                         "give a larger --steps to continue.")
    wall = time.perf_counter() - t_start
    if metrics is not None:
        metrics.close()
    job.trace = trace
    return history, start, peak, saved, wall, comp


def _evaluate_now(job: _Job, comp) -> float:
    """The validation loss now (the training weights copied into the evaluation twin first, if any)."""
    lowering, eval_lowering = job.lowering, job.eval_lowering
    if job.pipeline is not None:  # forward passes through the stages
        return job.pipeline.evaluate(job.dataset, job.cfg.eval_batches)
    if eval_lowering is not lowering:
        for name in lowering.variable_names:
            if name in eval_lowering.variable_names:
                eval_lowering.set_variable_value(name, lowering.variable_value(name))
    comp.before("evaluation step")
    t0 = time.perf_counter()
    val = evaluate(eval_lowering, job.eval_lm, job.dataset, job.cfg.eval_batches, job.cfg.accumulate)
    comp.after("evaluation step", time.perf_counter() - t0, steps=0, session=eval_lowering.session)
    return val


def _report(job: _Job, history: dict, start: int, peak: float, peak_what: str, saved, wall: float, comp) -> dict:
    """Print throughput, MFU, the validation result, the communication summary (and the flight recorder's
    report), where the checkpoint is; plot the loss curve; sample. Returns :func:`main_train`'s result."""
    cfg, paths, model, say, world = job.cfg, job.paths, job.model, job.say, world_size()
    bpt = job.dataset.bytes_per_token
    fpt = _flops_per_token(model)
    tokens_per_step = model.batch_size * model.length
    steady_steps = cfg.steps - start - comp.steps  # throughput: steady-state steps only, compiling excluded
    tps = max(steady_steps, 1) * tokens_per_step / max(wall - comp.seconds, 1e-9)
    val = history["val_loss"][-1]
    if comp.seconds:
        say(f"compile seconds: {comp.seconds:.1f} ({comp.describe()}); excluded from tokens/s and MFU below")
    say(f"done: {cfg.steps - start} steps in {wall:.1f} s, {tps:.0f} tokens/s ({tps / world:.0f} per process, "
        f"{world} process{'es' if world > 1 else ''}), MFU {100 * mfu(tps * fpt, peak):.2f}% (of {peak / 1e9:.1f} "
        f"GFLOP/s: {peak_what})")
    say(f"validation: {val:.4f} nats/token, {val / math.log(2) / bpt:.4f} bits per byte")
    say(job.lowering.counters.summary(detail=cfg.comm_detail,
                                      header=f"mesh {cfg.mesh!r}, layout {cfg.layout!r}, storage "
                                             f"{cfg.storage or '(none: as the layout)'!r}"))
    if job.trace is not None:
        say(collective_report(job.trace, top=5))
    if saved:
        how = "meshtorch sample" if paths.default_layout else f"meshtorch sample --checkpoint-dir {cfg.checkpoint_dir}"
        say(f"checkpoint: {saved} (decode it: {how}; continue it: meshtorch train --resume"
            f"{'' if paths.default_layout else ' --checkpoint-dir ' + cfg.checkpoint_dir} --steps N)")
    if cfg.plot and job.main_process:
        plot_history(history, cfg.plot, bpt, title=f"{model.num_layers} layers x d_model {model.d_model}; mesh "
                     f"{cfg.mesh or '(1 processor)'}; layout {cfg.layout or '(replicated)'}"
                     + (f"; storage {cfg.storage}" if cfg.storage else ""))
        say(f"loss curve: {cfg.plot}")
    ids = None
    if cfg.sample and job.pipeline is not None:
        say("sample: not decoded by the stage executor; decode the checkpoint with meshtorch sample")
    elif cfg.sample and getattr(job.lm, "encoder_decoder", False):
        say("sample: T5 runs are not decoded here (no input text); decode the checkpoint with meshtorch sample "
            "--prompt INPUT")
    elif cfg.sample:  # every process decodes (the logits fetch gathers full tensors); the main one prints
        ids = sample(job.eval_lowering, job.eval_lm, job.tok.encode(cfg.prompt), max_new_tokens=cfg.sample,
                     temperature=cfg.temperature, top_k=cfg.top_k, seed=cfg.seed,
                     eos_ids=getattr(model, "eos_ids", ()))[0]
        say("sample:\n" + cfg.prompt + job.tok.decode(ids))
    return {"history": history, "val_bits_per_byte": val / math.log(2) / bpt, "tokens_per_s": tps,
            "lowering": job.lowering, "lm": job.lm, "sample_ids": ids}


def _resume_check(args: TrainConfig, record: dict) -> tuple:
    """The checkpoint ``--resume`` / ``--resume-from`` names, checked against this run's model and data before
    the model is built: ``(path, older checkpoints, its extra, whether --force-data applies)``.

    Raises:
        UsageError: naming ``--resume`` and the differing field, if the checkpoint's model config or tokenizer
            differ, or its data fingerprint differs without ``--force-data``; or nothing to resume.
    """
    flag = "--resume-from" if args.resume_from else "--resume"
    point, older = resume_point(args.checkpoint_dir, args.resume_from)
    if point is None:
        raise runs.nothing_to_resume(flag, args.checkpoint_dir)
    saved = load_manifest(point).get("extra") or {}
    bad = runs.resume_mismatch(saved, record)
    force = bad is not None and bad[0] == "data" and args.force_data
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
    # --accumulate's accumulators are scratch (overwritten by each step's first microbatch): a checkpoint written
    # with another --accumulate (or none) may lack them; so may a checkpoint of another --precision lack fp16's loss
    # scale (it starts again from its initial scale); every other variable must be there
    held = load_manifest(point).get("variables", {})
    scratch = all(n in held or n.endswith("/" + ACCUMULATOR_SUFFIX) or n in LOSS_SCALE_VARIABLES
                  for n in lowering.variable_names)
    try:
        meta = restore(lowering, point, strict=not scratch)
    except CheckpointError as e:
        raise CheckpointError(f"{e} ({older_hint(older)})") from None
    pos = {} if force else saved.get("data", {})
    start, epoch, in_epoch = meta["step"], pos.get("epoch", 0), pos.get("batch", 0)
    record["run"] = saved.get("run") or record["run"]
    for k, v in (saved.get("history") or {}).items():
        if k in history:
            history[k].extend(v)
    say(f"resumed from {meta['path']} at step {start} (epoch {epoch}, batch {in_epoch})"
        + (": --force-data, the data position starts over on the new data" if force else "")
        + runs.resume_changes(saved, record))  # what may change on resume (issue 35)
    return start, epoch, in_epoch


def _set_global_step(lowering, step: int) -> None:
    """Set every ``global_step`` counter of ``lowering`` (the optimizer's: the schedules read it) to ``step``."""
    for name in lowering.variable_names:
        if name == GLOBAL_STEP_NAME or name.endswith("/" + GLOBAL_STEP_NAME):
            value = lowering.variable_value(name)
            lowering.set_variable_value(name, torch.full_like(value, step))


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
