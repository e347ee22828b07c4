"""The ``meshtorch mnist`` job: train the Mesh TF README model on (Fashion-)MNIST.

The training loop is shared by the command line (:mod:`meshtorch.cli.mnist`) and the tests. Batches
are drawn from a permutation made by a ``torch.Generator`` seeded with ``seed`` alone, so runs
under different meshes and layouts see exactly the same batches in the same order.

The same code runs as one process (a simulated mesh, :class:`~meshtorch.mesh.placement.PlacementMeshImpl`)
or as one process per processor under ``torchrun`` / ``meshtorch launch``
(:class:`~meshtorch.mesh.spmd.SpmdMeshImpl`, chosen by :func:`meshtorch.mesh.make_mesh_impl`). Every
process draws the same permutation but reads only the examples of its own batch slice
(:func:`~meshtorch.data.sharding.local_batch_indices`) and feeds them with ``feed_slices=True``;
evaluation feeds slices the same way and gathers the logits. Only the main process prints.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from meshtorch.core.errors import RunFailure, UsageError
from meshtorch.data.mnist import load_mnist
from meshtorch.data.sharding import local_batch_indices, local_feed
from meshtorch.lowering import Lowering
from meshtorch.mesh.factory import make_mesh_impl
from meshtorch.mesh.recorder import collective_report, flight_recorder
from meshtorch.models.mnist import MnistModel, build_mnist_model
from meshtorch.models.mnist_conv import build_conv_model, pixel_stats
from meshtorch.runtime import checks
from meshtorch.runtime.optional import optional_module


@dataclass
class EpochStats:
    """One epoch: mean training loss over its steps, test accuracy (None if not evaluated), throughput."""

    epoch: int
    train_loss: float
    test_accuracy: float | None
    examples_per_sec: float
    train_seconds: float
    eval_seconds: float = 0.0


@dataclass
class MnistRun:
    """Result of :func:`train_mnist`: per-epoch stats, every step's loss, the model and its lowering."""

    epochs: list[EpochStats]
    step_losses: list[float]
    model: MnistModel
    lowering: Lowering
    wall_seconds: float = 0.0
    config: dict = field(default_factory=dict)


MODEL_DEFAULTS = {
    "mlp": {"mesh": "rows:2;cols:2", "layout": "batch:rows;hidden:cols", "epochs": 3, "batch_size": 100,
            "hidden": 1024, "lr": 0.1},
    "conv": {"mesh": "b1:2;b2:2", "layout": "row_blocks:b1;col_blocks:b2", "epochs": 2, "batch_size": 200,
             "hidden": 512, "lr": 0.01},
}


def local_feeds(model: MnistModel, lowering: Lowering, images: torch.Tensor, labels: torch.Tensor,
                batch_ids: torch.Tensor) -> dict:
    """``feed_slices=True`` feeds for the batch of example ids ``batch_ids`` (int64 ``[batch]``).

    Reads only the rows of ``images`` (uint8 or float ``[N, rows, cols]``) and ``labels`` (``[N]``) that
    this process's slices of the ``images`` / ``labels`` placeholders hold (all of them on a placement
    mesh). Ids ``>= N`` (padding) read as zero images with label 0.
    """
    feeds = {}
    for t, src in ((model.images, images), (model.labels, labels)):
        ids = local_batch_indices(lowering, t, indices=batch_ids)
        pad = ids >= src.shape[0]
        rows = src[ids.clamp(max=src.shape[0] - 1)]
        if bool(pad.any()):
            rows = rows.clone()
            rows[pad] = 0
        if t is model.images and rows.dtype == torch.uint8:
            rows = rows.to(torch.float32) / 255.0
        if t is model.images and hasattr(model, "prepare_images"):  # e.g. the conv model's blocks
            rows = model.prepare_images(rows)
        feeds[t] = local_feed(lowering, t, rows.to(t.dtype))
    return feeds


def evaluate(model: MnistModel, lowering: Lowering, images: torch.Tensor, labels: torch.Tensor) -> float:
    """Accuracy of ``argmax(logits)`` on ``images`` uint8 ``[N, rows, cols]``, ``labels`` ``[N]``.

    Each process feeds only its batch slices (``feed_slices=True``); the logits ``[batch, classes]``
    are gathered (an all-gather under SPMD), so every process returns the same accuracy. The last
    batch is padded with zeros when ``N`` is not a multiple of the batch size; padded rows are not
    counted.
    """
    b = model.batch.size
    n = images.shape[0]
    correct = 0
    for start in range(0, n, b):
        k = min(b, n - start)
        ids = torch.arange(start, start + b, dtype=torch.int64)
        logits = lowering.run(model.logits, feeds=local_feeds(model, lowering, images, labels, ids),
                              feed_slices=True)
        correct += int((logits[:k].argmax(dim=-1) == labels[start:start + k]).sum())
    return correct / max(n, 1)


def train_mnist(mesh_shape: str = "", layout: str = "", epochs: int = 3, batch_size: int = 100,
                hidden: int = 1024, lr: float = 0.1, seed: int = 0, data_dir: str | None = None,
                data: tuple | None = None, steps_per_epoch: int | None = None, evaluate_each_epoch: bool = True,
                progress: bool = False, log: Callable[[str], None] | None = None,
                start_log: Callable[[str], None] | None = None,
                activation_dtype: torch.dtype = torch.float32, model_kind: str = "mlp",
                activation: str = "relu") -> MnistRun:
    """Train the README MNIST model with SGD; evaluate after each epoch.

    The mesh is :func:`meshtorch.mesh.make_mesh_impl`'s: SPMD (one processor per process) under
    torchrun / ``meshtorch launch``, else a simulated placement mesh. Each process reads only its
    batch slices. ``progress`` and ``log`` act on the main process only.

    Args:
        mesh_shape, layout: e.g. ``"rows:2;cols:2"``, ``"batch:rows;hidden:cols"``.
        epochs, batch_size, hidden, lr, seed: as the command-line flags.
        data_dir: IDX files directory (default Fashion-MNIST's Debian location).
        data: optional ``((train_images, train_labels), (test_images, test_labels))`` already loaded.
        steps_per_epoch: optional cap on steps per epoch (default: every full batch).
        evaluate_each_epoch: compute test accuracy after each epoch.
        progress: show a tqdm bar.
        log: called with one line per epoch (e.g. ``print``).
        start_log: called once with a line describing the run (mesh, layout, processes, threads).
        activation_dtype: compute dtype (e.g. ``torch.bfloat16``); weights stay float32 (mlp only).
        model_kind: ``"mlp"`` (Mesh TF's README model) or ``"conv"`` (Mesh TF's examples/mnist.py:
            blocked 9x9 convolutions with halo exchange, momentum SGD with a 100-step warmup, pixels
            standardized by the training set's mean and std; ``hidden`` and ``lr`` apply).
        activation: conv model only: ``"relu"`` (Mesh TF) or ``"gelu"`` (float32 layouts then agree to
            ~1e-6 over whole runs instead of drifting apart chaotically, see
            :func:`meshtorch.models.mnist_conv.build_conv_model`).

    Returns:
        :class:`MnistRun`.

    Raises:
        DataError: if the data files are missing or malformed. LayoutError: on an illegal layout.
        ValueError: if the training set holds fewer examples than one batch.
    """
    t_start = time.perf_counter()
    if data is None:
        data = (load_mnist("train", data_dir), load_mnist("test", data_dir))
    (train_x, train_y), (test_x, test_y) = data
    n = train_x.shape[0]
    if n < batch_size:
        raise ValueError(f"mnist: the training set has {n} examples, fewer than one batch of {batch_size}.")
    if model_kind != "conv" and activation != "relu":
        raise ValueError("mnist: --activation applies to the conv model only (the mlp model is Mesh TF's ReLU MLP).")
    if model_kind == "conv":
        if activation_dtype != torch.float32:
            raise ValueError("mnist: --activation-dtype applies to the mlp model only.")
        mean, std = pixel_stats(train_x)
        model = build_conv_model(batch_size=batch_size, seed=seed, hidden_size=hidden, learning_rate=lr,
                                 rows=train_x.shape[1], cols=train_x.shape[2], activation=activation,
                                 input_mean=mean, input_std=std if std > 0 else 1.0)
    elif model_kind == "mlp":
        model = build_mnist_model(batch_size=batch_size, hidden_size=hidden, learning_rate=lr, seed=seed,
                                  rows=train_x.shape[1], cols=train_x.shape[2], activation_dtype=activation_dtype)
    else:
        raise ValueError(f"mnist: unknown model {model_kind!r}; choose mlp or conv.")
    impl = make_mesh_impl(mesh_shape, layout)
    lowering = Lowering(model.graph, {model.mesh: impl})
    main_process = impl.is_leader()
    progress = progress and main_process
    log = log if main_process else None
    if start_log is not None and main_process:
        procs = impl.size // len(impl.local_pnums())
        what = f"{model_kind}, {activation}" if model_kind == "conv" else model_kind
        start_log(f"meshtorch mnist ({what}): mesh {mesh_shape!r} layout {layout!r} epochs {epochs} batch {batch_size} "
                  f"hidden {hidden} lr {lr} seed {seed} processes {procs} threads {torch.get_num_threads()}")
    fetches = model.train_fetches()
    steps = n // batch_size if steps_per_epoch is None else min(steps_per_epoch, n // batch_size)
    gen = torch.Generator().manual_seed(seed)
    stats, step_losses = [], []
    for epoch in range(1, epochs + 1):
        perm = torch.randperm(n, generator=gen)
        bar = None
        if progress:
            tqdm = optional_module("tqdm", "meshtorch mnist's progress bar (--no-progress: none)").tqdm
            bar = tqdm(total=steps, desc=f"epoch {epoch}/{epochs}", unit="step", leave=False)
        t0 = time.perf_counter()
        epoch_losses = []
        for s in range(steps):
            idx = perm[s * batch_size:(s + 1) * batch_size]
            loss = lowering.run(fetches, feeds=local_feeds(model, lowering, train_x, train_y, idx), feed_slices=True)[0]
            epoch_losses.append(float(loss))
            why = checks.divergence(epoch_losses[-1], step_losses[0] if step_losses else epoch_losses[0])
            if why:
                raise RunFailure(f"training diverged: {why} at step {s + 1} of epoch {epoch}; lower --lr (now {lr}).")
            if bar is not None:
                bar.update(1)
                if s % 20 == 0:
                    bar.set_postfix(loss=f"{epoch_losses[-1]:.4f}")
        train_s = time.perf_counter() - t0
        if bar is not None:
            bar.close()
        acc, eval_s = None, 0.0
        if evaluate_each_epoch:
            t1 = time.perf_counter()
            acc = evaluate(model, lowering, test_x, test_y)
            eval_s = time.perf_counter() - t1
        step_losses += epoch_losses
        st = EpochStats(epoch, sum(epoch_losses) / len(epoch_losses), acc, steps * batch_size / train_s, train_s,
                        eval_s)
        stats.append(st)
        if log is not None:
            acc_s = "n/a" if acc is None else f"{100 * acc:.2f}%"
            log(f"epoch {epoch}/{epochs}: train loss {st.train_loss:.4f}  test accuracy {acc_s}  "
                f"{st.examples_per_sec:,.0f} examples/s  ({train_s:.1f}s train, {eval_s:.1f}s eval)")
    config = dict(mesh=mesh_shape, layout=layout, epochs=epochs, batch_size=batch_size, hidden=hidden, lr=lr,
                  seed=seed, model=model_kind, activation=activation)
    return MnistRun(stats, step_losses, model, lowering, time.perf_counter() - t_start, config)


def check_args(args) -> None:
    """Check every ``meshtorch mnist`` flag before the data is read or the model built (defaults filled in).

    Raises:
        UsageError: naming the flag: a number out of range, a missing ``--data-dir``, a mesh size that is not
            a positive integer. LayoutError: a ``--layout`` rule matching no dimension of the model or no
            axis of the mesh (naming the rule, listing both).
    """
    for k, v in MODEL_DEFAULTS[args.model].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    for what in ("epochs", "batch_size", "hidden", "lr", "steps_per_epoch"):
        checks.positive("--" + what.replace("_", "-"), getattr(args, what))
    checks.non_negative("--threads", args.threads)
    mesh = checks.mesh_shape("--mesh", args.mesh)
    if args.model == "conv":
        graph = build_conv_model(batch_size=args.batch_size, hidden_size=args.hidden).graph
    else:
        graph = build_mnist_model(batch_size=args.batch_size, hidden_size=args.hidden).graph
    checks.layout_rules("--layout", args.layout, checks.graph_dim_names(graph), mesh)
    if not os.path.isdir(args.data_dir):
        raise UsageError(f"--data-dir {args.data_dir!r} is not a directory; give the directory holding the IDX "
                         "files (train-images-idx3-ubyte, ...).")


def main_mnist(args) -> int:
    """Run the job from parsed arguments; print per-epoch results and the communication summary."""
    check_args(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    trace = None
    if getattr(args, "trace_collectives", False):
        trace = flight_recorder().sink = []  # every collective record of the job (the ring keeps the last few)
    run = train_mnist(args.mesh, args.layout, args.epochs, args.batch_size, args.hidden, args.lr, args.seed,
                      args.data_dir, steps_per_epoch=args.steps_per_epoch, evaluate_each_epoch=not args.no_eval,
                      activation_dtype=getattr(torch, args.activation_dtype), model_kind=args.model,
                      activation=args.activation,
                      progress=not args.no_progress, log=lambda s: print(s, flush=True),
                      start_log=lambda s: print(s, flush=True))
    if next(iter(run.lowering.mesh_to_impl.values())).is_leader():  # rank 0 only, under torchrun
        print(run.lowering.counters.summary())
        if trace is not None:
            print(collective_report(trace, top=5))
        print(f"wall time {run.wall_seconds:.1f}s")
    if trace is not None:
        flight_recorder().sink = None
    return 0
