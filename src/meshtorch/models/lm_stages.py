"""A prototype stage executor: the LM cut into per-virtual-stage programs, run in a schedule table's order.

Issue 32, item 2, on a placement mesh in one process: virtual stage ``v`` of ``V = S R`` (on rank ``v mod S``)
is its own meshtorch graph, lowered with the layout of the mesh *inside* a stage (data, model, storage rules):
stage 0 the embeddings and layer 0, stage ``v`` layer ``v``, the last stage also the final norm, logits and the
microbatch's mean loss. Each graph holds, besides its forward output, the gradient programs
(:func:`meshtorch.autodiff.gradients` with an upstream-gradient placeholder): with respect to its input (``I``)
and to its weights (``W``); ``B`` runs both. :func:`run_schedule` walks
:attr:`~meshtorch.core.schedules.ScheduleTable.timed` step by step and runs, per action, only that program on
that microbatch: idle steps run nothing, the embeddings run only on stage 0 and the loss only on the last.
The transfers between ranks are tensors handed from one stage's program to the next, counted per send.

What it is not (yet): one process per rank with ``torch.distributed`` point-to-point transfers, fast (every
gradient program recomputes its stage's forward pass from the stashed input), or wired to ``meshtorch train``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from meshtorch.autodiff import gradients
from meshtorch.core.graph import Graph, Mesh
from meshtorch.core.mesh_spec import MeshSpec
from meshtorch.core.schedules import ScheduleTable
from meshtorch.layers import dense, softmax_cross_entropy_with_logits
from meshtorch.lowering import Lowering
from meshtorch.models.transformer import LMConfig, _block, _embed, _norm, dims
from meshtorch.ops.initializers import VarianceScalingInitializer, random_normal_initializer
from meshtorch.ops.reduce import reduce_mean
from meshtorch.ops.variables import get_variable, import_tensor, placeholder

__all__ = ["StageProgram", "ScheduleRun", "stage_programs", "run_schedule"]


@dataclass
class StageProgram:
    """Virtual stage ``stage``'s lowered programs: ``inputs`` (ids on stage 0, else the hidden state
    ``[batch/M, length, d_model]``), ``output`` (hidden state, or the microbatch's mean loss on the last stage),
    ``output_grad`` (placeholder of the upstream gradient; None on the last stage), ``input_grad`` (None on
    stage 0), ``weights`` and ``weight_grads`` (by variable name), ``targets`` (last stage)."""

    stage: int
    lowering: Lowering
    inputs: object
    output: object
    output_grad: object | None
    input_grad: object | None
    weights: dict
    weight_grads: dict
    targets: object | None = None


def stage_programs(config: LMConfig, stages: int, microbatches: int, repeats: int = 1, mesh_shape: str = "",
                   layout: str = "", storage: str = "", seed: int = 0) -> list[StageProgram]:
    """The ``V = stages x repeats`` virtual stages of the unpipelined LM ``config`` (``num_layers == V``, one
    layer each), each a graph of one microbatch (``batch_size / microbatches`` sequences) lowered on
    ``MeshSpec(mesh_shape, layout, storage)``. Variables keep the unpipelined LM's names (``embedding``,
    ``layer_{v}/...``, ``final_norm/...``, ``logits/kernel``) and so, drawn from ``seed`` by name, its initial values.

    Raises:
        ValueError: ``num_layers != V``, a batch that ``microbatches`` does not divide, dropout, MoE layers, or a
            pipelined ``config`` (give the unpipelined one).
    """
    V = stages * repeats
    if config.num_layers != V:
        raise ValueError(f"stage_programs: num_layers ({config.num_layers}) must be stages x repeats ({V}).")
    if config.batch_size % microbatches:
        raise ValueError(f"stage_programs: microbatches ({microbatches}) must divide batch_size "
                         f"({config.batch_size}).")
    if config.dropout > 0 or config.num_experts > 0 or config.pipelined:
        raise ValueError("stage_programs: an unpipelined dense config without dropout, please.")
    c = replace(config, batch_size=config.batch_size // microbatches)
    d = dims(c)
    out = []
    for v in range(V):
        graph = Graph(seed=seed)
        mesh = Mesh(graph, "mesh")
        if v == 0:
            inputs = placeholder(mesh, "inputs", [d["batch"], d["length"]], dtype=torch.int64)
            emb = get_variable(mesh, "embedding", [d["vocab"], d["d_model"]],
                               initializer=random_normal_initializer(0.0, 1.0))
            pos = get_variable(mesh, "pos_embedding", [d["length"], d["d_model"]],
                               initializer=random_normal_initializer(0.0, 0.02))
            x = _embed(inputs, emb, d) + pos
        else:
            inputs = placeholder(mesh, "stage_input", [d["batch"], d["length"], d["d_model"]])
            x = inputs
        y = _block(c, d, x, f"layer_{v}", False, [])
        targets = None
        if v == V - 1:  # as build_lm's head
            targets = placeholder(mesh, "targets", [d["batch"], d["length"]], dtype=torch.int64)
            h = _norm(c, y, d["d_model"], "final_norm")
            logits = dense(h, d["vocab"], use_bias=False, name="logits",
                           kernel_initializer=VarianceScalingInitializer(1.0, "fan_in", "normal", [d["d_model"]],
                                                                         [d["vocab"]]))
            if c.padded_vocab != c.vocab_size:
                mask = torch.zeros(c.padded_vocab)
                mask[c.vocab_size:] = -1e9
                logits = logits + import_tensor(mesh, mask, [d["vocab"]], name="vocab_pad_mask")
            if c.label_smoothing:
                raise ValueError("stage_programs: label smoothing is not supported.")
            y = reduce_mean(softmax_cross_entropy_with_logits(logits, targets, d["vocab"], z_loss=c.z_loss),
                            name="loss")
        weights = {w.name: w for w in graph.trainable_variables}
        dy = None if v == V - 1 else placeholder(mesh, "stage_output_grad", y.shape)
        names = list(weights)
        grads = gradients([y], ([inputs] if v else []) + [weights[n] for n in names],
                          grad_ys=None if dy is None else [dy])
        gin, gw = (grads[0], grads[1:]) if v else (None, grads)
        lw = Lowering(graph, {mesh: MeshSpec(mesh_shape, layout, storage=storage or None)})
        out.append(StageProgram(v, lw, inputs, y, dy, gin, weights, dict(zip(names, gw, strict=True)), targets))
    return out


@dataclass
class ScheduleRun:
    """What :func:`run_schedule` returns: ``loss`` (mean over the microbatches), ``grads`` (by variable name,
    of that mean), ``actions`` per rank in the order run, ``sends`` (transfers between different ranks),
    ``peak_stash`` per rank (the most stage inputs it held at once)."""

    loss: float
    grads: dict
    actions: list = field(default_factory=list)
    sends: int = 0
    peak_stash: list = field(default_factory=list)


def run_schedule(table: ScheduleTable, programs: list[StageProgram], ids: torch.Tensor,
                 targets: torch.Tensor) -> ScheduleRun:
    """Run one step's forward and backward passes in ``table``'s order.

    Args:
        table: the schedule (its ``S R`` must be ``len(programs)``).
        programs: :func:`stage_programs` (same ``M``).
        ids, targets: int64 ``[batch, length]``; microbatch ``m`` is rows ``m B/M .. (m+1) B/M - 1``.

    Returns:
        :class:`ScheduleRun`; the gradients are accumulated over microbatches and divided by ``M``.
    """
    S, M, V = table.stages, table.microbatches, table.virtual_stages
    if len(programs) != V:
        raise ValueError(f"run_schedule: {len(programs)} stage programs for {V} virtual stages.")
    ids_m, tg_m = ids.chunk(M), targets.chunk(M)
    acts: dict = {}  # (v, m) -> input of stage v for microbatch m (received or fed)
    grads_in: dict = {}  # (v, m) -> gradient of stage v's output for microbatch m
    stash: list[set] = [set() for _ in range(S)]
    run = ScheduleRun(0.0, {}, [[] for _ in range(S)], 0, [0] * S)
    for row in table.timed:
        for r, a in enumerate(row):
            if a is None:  # idle: nothing runs
                continue
            p, v, m = programs[a.stage], a.stage, a.microbatch
            feeds = {p.inputs: ids_m[m] if v == 0 else acts[(v, m)]}
            if p.targets is not None:
                feeds[p.targets] = tg_m[m]
            if p.output_grad is not None and a.kind != "F":
                feeds[p.output_grad] = grads_in[(v, m)]
            run.actions[r].append(a)
            if a.kind == "F":
                y = p.lowering.run(p.output, feeds)
                stash[r].add((v, m))
                run.peak_stash[r] = max(run.peak_stash[r], len(stash[r]))
                if v == V - 1:
                    run.loss += float(y) / M
                else:
                    acts[(v + 1, m)] = y
                    run.sends += table.rank_of(v + 1) != r
                continue
            fetch_in = a.kind in ("B", "I") and p.input_grad is not None
            fetch_w = a.kind in ("B", "W")
            names = list(p.weight_grads) if fetch_w else []
            out = p.lowering.run(([p.input_grad] if fetch_in else []) + [p.weight_grads[n] for n in names], feeds)
            if fetch_in:
                grads_in[(v - 1, m)] = out[0]
                run.sends += table.rank_of(v - 1) != r
                out = out[1:]
            for n, g in zip(names, out, strict=True):
                run.grads[n] = run.grads[n] + g if n in run.grads else g.clone()
            if fetch_w:  # the stage's input is no longer needed
                stash[r].discard((v, m))
    run.grads = {n: g / M for n, g in run.grads.items()}
    return run
