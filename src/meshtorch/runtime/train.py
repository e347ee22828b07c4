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

from meshtorch.checkpoint import latest_checkpoint, restore, save
from meshtorch.data.sharding import local_batch_indices, local_feed
from meshtorch.data.text import ByteTokenizer, PackedDataset, SentencePieceTokenizer, load_documents
from meshtorch.lowering import Lowering
from meshtorch.mesh.factory import make_mesh_impl
from meshtorch.mesh.placement import PlacementMeshImpl
from meshtorch.mesh.process import init_distributed
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
from meshtorch.runtime.generate import sample
from meshtorch.runtime.optional import optional_module

DEFAULT_MESH = "data:2,model:2"
DEFAULT_LAYOUT = "batch:data;heads:model;d_ff:model;vocab:model"


def vocab_multiple(mesh_shape: str, layout: str) -> int:
    """The mesh-axis size that splits ``vocab`` under ``layout`` (1 if none)."""
    impl = PlacementMeshImpl(mesh_shape, layout)
    a = impl.tensor_dimension_to_mesh_axis("vocab")
    return 1 if a is None else impl.shape[a].size


def make_optimizer(args):
    """The optimizer named by ``--optimizer`` with the ``--schedule`` learning rate."""
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
    if args.optimizer == "adamw":
        return AdamWOptimizer(lr, weight_decay=args.weight_decay)
    if args.optimizer == "adam":
        return AdamOptimizer(lr, weight_decay=args.weight_decay)
    if args.optimizer == "adafactor":
        return AdafactorOptimizer(learning_rate=None if args.lr <= 0 else lr)
    if args.optimizer == "momentum":
        return MomentumOptimizer(lr, 0.9)
    return SgdOptimizer(lr)


def measure_peak_flops(seconds: float = 0.5, n: int = 512) -> float:
    """FLOP/s of a float32 ``n x n`` matmul loop on the CPU (the MFU denominator), measured once."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    count, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        count += 1
    return 2 * n ** 3 * count / (time.perf_counter() - t0)


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


def main_train(args) -> dict:
    """Run ``meshtorch train`` from its parsed arguments (:mod:`meshtorch.cli.train`); returns the history,
    bits per byte, tokens/s, the lowering, the LM and the sample ids.

    Raises:
        MeshtorchError: if tqdm (the ``meshtorch[cli]`` extra) is not installed.
    """
    tqdm = optional_module("tqdm", "meshtorch train's progress bar").tqdm
    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # under torchrun: join the job before anything prints
        init_distributed()
    impl = make_mesh_impl(args.mesh, args.layout)
    main_process = impl.is_leader()

    def say(*a):
        if main_process:
            print(*a, flush=True)

    docs = load_documents(args.data)
    if args.tokenizer == "sentencepiece":
        tok = SentencePieceTokenizer(docs, vocab_size=args.vocab_size)
        if args.checkpoint_dir and main_process:
            tok.save(os.path.join(args.checkpoint_dir, "tokenizer.model"))
    else:
        tok = ByteTokenizer()
    cfg = preset(args.preset, num_layers=args.layers, d_model=args.d_model, num_heads=args.heads, d_kv=args.d_kv,
                 d_ff=args.d_ff, length=args.length, batch_size=args.batch_size, dropout=args.dropout,
                 activation=args.activation, norm=args.norm, gated=args.gated or None, vocab_size=tok.vocab_size,
                 vocab_multiple=vocab_multiple(args.mesh, args.layout), num_experts=args.experts)
    dataset = PackedDataset.from_documents(docs, tok, cfg.length + 1)
    bpt = dataset.bytes_per_token  # bits per byte = nats / ln 2 / (bytes per token)
    lm = build_lm(cfg, seed=args.seed, optimizer=make_optimizer(args), clip_norm=args.clip_norm or None)
    lowering = Lowering(lm.graph, {lm.mesh: impl})
    eval_lm, eval_lowering = lm, lowering
    if cfg.dropout > 0:  # evaluate without dropout: a twin graph, weights copied before each evaluation
        eval_lm = build_lm(cfg, seed=args.seed, train=False)
        eval_lowering = Lowering(eval_lm.graph, {eval_lm.mesh: make_mesh_impl(args.mesh, args.layout)})
    n_params = sum(v.shape.size for v in lm.graph.trainable_variables)
    say(f"model: {cfg.num_layers} layers, d_model {cfg.d_model}, {cfg.num_heads} heads x d_kv {cfg.d_kv}, "
          f"d_ff {cfg.d_ff}, vocab {cfg.padded_vocab}, {n_params / 1e6:.2f}M parameters; "
          f"batch {cfg.batch_size} x length {cfg.length}")
    say(f"mesh {args.mesh!r} layout {args.layout!r}; {len(dataset.train)} train / "
          f"{len(dataset.validation)} validation sequences")
    peak = measure_peak_flops()
    fpt = flops_per_token(cfg)
    tokens_per_step = cfg.batch_size * cfg.length
    history = {"step": [], "loss": [], "val_step": [], "val_loss": []}
    fetches = [lm.loss] + lm.updates
    start, epoch, in_epoch = 0, 0, 0
    if args.resume:
        if not args.checkpoint_dir:
            raise SystemExit("--resume needs --checkpoint-dir")
        if latest_checkpoint(args.checkpoint_dir) is None:
            say(f"no checkpoint in {args.checkpoint_dir!r} yet: starting from scratch")
        else:
            meta = restore(lowering, args.checkpoint_dir)
            pos = (meta.get("extra") or {}).get("data", {})
            start, epoch, in_epoch = meta["step"], pos.get("epoch", 0), pos.get("batch", 0)
            say(f"resumed from {meta['path']} at step {start} (epoch {epoch}, batch {in_epoch})")
    it = dataset.batches(cfg.batch_size, args.seed, epoch)
    for _ in range(in_epoch):
        next(it)
    bar = tqdm(range(start, args.steps), desc="train", dynamic_ncols=True, mininterval=0.5,
               disable=not main_process)
    t_start = time.perf_counter()
    for step in bar:
        batch = next(it, None)
        if batch is None:
            epoch, in_epoch = epoch + 1, 0
            it = dataset.batches(cfg.batch_size, args.seed, epoch)
            batch = next(it)
        in_epoch += 1
        t0 = time.perf_counter()
        loss = lowering.run(fetches, feeds=batch_feeds(lowering, lm, batch), feed_slices=True)[0].item()
        dt = time.perf_counter() - t0
        history["step"].append(step)
        history["loss"].append(loss)
        tps = tokens_per_step / dt
        bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tps:.0f}", mfu=f"{100 * tps * fpt / peak:.1f}%")
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            if eval_lowering is not lowering:
                for name in lowering.variable_names:
                    if name in eval_lowering.variable_names:
                        eval_lowering.set_variable_value(name, lowering.variable_value(name))
            val = evaluate(eval_lowering, eval_lm, dataset, args.eval_batches)
            history["val_step"].append(step + 1)
            history["val_loss"].append(val)
            if main_process:
                tqdm.write(f"step {step + 1}: validation loss {val:.4f} nats/token, "
                           f"{val / math.log(2) / bpt:.4f} bits per byte")
        if args.checkpoint_dir and ((args.checkpoint_every and (step + 1) % args.checkpoint_every == 0)
                                    or step + 1 == args.steps):
            save(lowering, args.checkpoint_dir, step=step + 1, keep=args.keep,
                     extra={"data": {"epoch": epoch, "batch": in_epoch}, "config": cfg.to_dict(),
                            "mesh": args.mesh, "layout": args.layout, "tokenizer": args.tokenizer})
    if not history["val_loss"]:
        raise SystemExit(f"nothing to train: the checkpoint is already at step {start} >= --steps {args.steps}")
    wall = time.perf_counter() - t_start
    tps = (args.steps - start) * tokens_per_step / wall
    val = history["val_loss"][-1]
    say(f"done: {args.steps - start} steps in {wall:.1f} s, {tps:.0f} tokens/s, MFU {100 * tps * fpt / peak:.2f}% "
          f"(peak {peak / 1e9:.1f} GFLOP/s measured)")
    say(f"validation: {val:.4f} nats/token, {val / math.log(2) / bpt:.4f} bits per byte")
    say(lowering.counters.summary())
    if args.plot and main_process:
        _plot(history, args.plot, bpt)
        say(f"loss curve: {args.plot}")
    ids = None
    if args.sample:  # every process decodes (the logits fetch gathers full tensors); the main one prints
        ids = sample(eval_lowering, eval_lm, tok.encode(args.prompt), max_new_tokens=args.sample,
                     temperature=args.temperature, top_k=args.top_k, seed=args.seed)[0]
        say("sample:\n" + args.prompt + tok.decode(ids))
    return {"history": history, "val_bits_per_byte": val / math.log(2) / bpt, "tokens_per_s": tps,
            "lowering": lowering, "lm": lm, "sample_ids": ids}


def _plot(history: dict, path: str, bytes_per_token: float = 1.0) -> None:
    matplotlib = optional_module("matplotlib", "meshtorch train --plot")
    matplotlib.use("Agg")
    plt = optional_module("matplotlib.pyplot", "meshtorch train --plot")

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    k = 1.0 / math.log(2) / bytes_per_token
    ax.plot(history["step"], [v * k for v in history["loss"]], lw=0.8, label="train")
    ax.plot(history["val_step"], [v * k for v in history["val_loss"]], "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("bits per byte")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

