"""A prototype stage executor: the LM cut into per-virtual-stage programs, run in a schedule table's order.

Issue 32, item 2, on a placement mesh in one process: virtual stage ``v`` of ``V = S R`` (on rank ``v mod S``)
is its own meshtorch graph, lowered with the layout of the mesh *inside* a stage (data, model, storage rules):
stage 0 the embeddings and layer 0, stage ``v`` layer ``v``, the last stage also the final norm, logits and the
microbatch's mean loss. Each graph holds, besides its forward output, the gradient programs
(:func:`meshtorch.autodiff.gradients` with an upstream-gradient placeholder): with respect to its input (``I``)
and to its weights (``W``); ``B`` runs both. :func:`run_schedule` walks
:attr:`~meshtorch.core.schedules.ScheduleTable.timed` step by step and runs, per action, only that program on
that microbatch: idle steps run nothing, the embeddings run only on stage 0 and the loss only on the last.
The transfers between ranks are tensors handed from one stage's program to the next, counted per send;
:func:`run_rank` instead runs one rank per process of a ``torch.distributed`` group (gloo), each walking its own
row of actions and exchanging activations and gradients with ``isend``/``recv``.

What it is not (yet): fast (every gradient program recomputes its stage's forward pass from the stashed input),
an optimizer step, or wired to ``meshtorch train``; inside a stage the mesh is a placement mesh (simulated).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from meshtorch.autodiff import gradients
from meshtorch.core.graph import Graph, Mesh
from meshtorch.core.mesh_spec import MeshSpec
from meshtorch.core.schedules import ScheduleTable
from meshtorch.layers import dense, softmax_cross_entropy_with_logits
from meshtorch.lowering import Lowering
from meshtorch.models.transformer import LMConfig, _block, _embeddings, _norm, dims
from meshtorch.ops.initializers import VarianceScalingInitializer
from meshtorch.ops.reduce import reduce_mean
from meshtorch.ops.variables import import_tensor, placeholder

__all__ = ["StageProgram", "ScheduleRun", "run_rank", "run_schedule", "stage_programs"]


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
                   layout: str = "", storage: str = "", seed: int = 0, rank: int | None = None) -> list:
    """The ``V = stages x repeats`` virtual stages of the unpipelined LM ``config`` (``num_layers`` a multiple of
    ``V``: stage ``v`` runs layers ``v L/V .. (v+1) L/V - 1``), each a graph of one microbatch (``batch_size /
    microbatches`` sequences) lowered on ``MeshSpec(mesh_shape, layout, storage)``. Variables keep the
    unpipelined LM's names (``embedding``, ``layer_{i}/...``, ``final_norm/...``, ``logits/kernel``) and so, drawn
    from ``seed`` by name, its initial values.
    ``rank``: build only that rank's virtual stages (``v mod stages == rank``; None in the other entries).

    Raises:
        ValueError: ``num_layers`` not a multiple of ``V``, a batch that ``microbatches`` does not divide, dropout,
            MoE layers, label smoothing, or a pipelined ``config`` (give the unpipelined one).
    """
    V = stages * repeats
    if config.num_layers % V:
        raise ValueError(f"stage_programs: num_layers ({config.num_layers}) must be a multiple of stages x repeats "
                         f"({V}).")
    per = config.num_layers // V
    if config.batch_size % microbatches:
        raise ValueError(f"stage_programs: microbatches ({microbatches}) must divide batch_size "
                         f"({config.batch_size}).")
    if config.pipelined:
        raise ValueError("stage_programs: give the unpipelined config (pipeline_stages=0); the stages come from "
                         "the schedule.")
    if config.dropout > 0:
        raise ValueError("stage_programs: dropout > 0 is not supported (each gradient program recomputes its "
                         "forward pass, which would draw other masks); set dropout=0.")
    if config.num_experts > 0:
        raise ValueError("stage_programs: MoE layers are not supported (their load-balancing loss would have to "
                         "leave every stage); set num_experts=0.")
    c = replace(config, batch_size=config.batch_size // microbatches)
    d = dims(c)
    out = []
    for v in range(V):
        if rank is not None and v % stages != rank:
            out.append(None)
            continue
        graph = Graph(seed=seed)
        mesh = Mesh(graph, "mesh")
        if v == 0:
            inputs = placeholder(mesh, "inputs", [d["batch"], d["length"]], dtype=torch.int64)
            x = _embeddings(mesh, inputs, d)
        else:
            inputs = placeholder(mesh, "stage_input", [d["batch"], d["length"], d["d_model"]])
            x = inputs
        y = x
        for i in range(v * per, (v + 1) * per):
            y = _block(c, d, y, f"layer_{i}", False, [])
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
    """What :func:`run_schedule` / :func:`run_rank` return: ``loss`` (mean over the microbatches; :func:`run_rank`:
    None except on the last stage's rank), ``grads`` (by variable name, of that mean; :func:`run_rank`: this
    rank's variables), ``actions`` per rank in the order run, ``sends`` (transfers to a different rank),
    ``peak_stash`` per rank (the most stage inputs it held at once)."""

    loss: float | None
    grads: dict
    actions: list = field(default_factory=list)
    sends: int = 0
    peak_stash: list = field(default_factory=list)
    wait_s: float = 0.0  # run_rank: seconds spent waiting for receives and the last sends


class _Executor:
    """Runs actions; transfers between ranks are dict entries here (:class:`_DistExecutor`: gloo messages)."""

    def __init__(self, table: ScheduleTable, programs: list, ids: torch.Tensor, targets: torch.Tensor):
        S, M, V = table.stages, table.microbatches, table.virtual_stages
        if len(programs) != V:
            raise ValueError(f"run_schedule: {len(programs)} stage programs for {V} virtual stages.")
        self.table, self.programs, self.M, self.V = table, programs, M, V
        self.ids, self.targets = ids.chunk(M), targets.chunk(M)
        self.acts: dict = {}  # (v, m) -> input of stage v for microbatch m
        self.grads_in: dict = {}  # (v, m) -> gradient of stage v's output for microbatch m
        self.stash: list[set] = [set() for _ in range(S)]
        self.run = ScheduleRun(0.0, {}, [[] for _ in range(S)], 0, [0] * S)

    def send(self, store: dict, key, value, src: int, dst: int, tag: int) -> None:
        store[key] = value
        self.run.sends += src != dst

    def receive(self, store: dict, key, src: int, dst: int, tag: int, like) -> torch.Tensor:
        return store[key]

    def execute(self, a, r: int) -> None:
        """Rank ``r`` runs action ``a``: its stage program's forward, input-gradient and/or weight-gradient
        fetches on microbatch ``a.microbatch``."""
        p, v, m, M, V, t = self.programs[a.stage], a.stage, a.microbatch, self.M, self.V, self.table
        tag = 2 * (v * M + m)  # even: the activation entering stage v; odd: the gradient leaving stage v's output
        x = self.ids[m] if v == 0 else self.receive(self.acts, (v, m), t.rank_of(v - 1), r, tag, p.inputs)
        feeds = {p.inputs: x}
        if p.targets is not None:
            feeds[p.targets] = self.targets[m]
        if p.output_grad is not None and a.kind != "F":
            feeds[p.output_grad] = self.receive(self.grads_in, (v, m), t.rank_of(v + 1), r,
                                                2 * ((v + 1) * M + m) + 1, p.output_grad)
        self.run.actions[r].append(a)
        if a.kind == "F":
            y = p.lowering.run(p.output, feeds)
            self.acts[(v, m)] = x  # the stash, until the backward is done
            self.stash[r].add((v, m))
            self.run.peak_stash[r] = max(self.run.peak_stash[r], len(self.stash[r]))
            if v == V - 1:
                self.run.loss += float(y) / M
            else:
                self.send(self.acts, (v + 1, m), y, r, t.rank_of(v + 1), 2 * ((v + 1) * M + m))
            return
        fetch_in = a.kind in ("B", "I") and p.input_grad is not None
        names = list(p.weight_grads) if a.kind in ("B", "W") else []
        out = p.lowering.run(([p.input_grad] if fetch_in else []) + [p.weight_grads[n] for n in names], feeds)
        if fetch_in:
            self.send(self.grads_in, (v - 1, m), out[0], r, t.rank_of(v - 1), tag + 1)
            out = out[1:]
        for n, g in zip(names, out, strict=True):
            self.run.grads[n] = self.run.grads[n] + g if n in self.run.grads else g.clone()
        if names:  # the stage's input and output gradient are no longer needed
            self.stash[r].discard((v, m))
            self.acts.pop((v, m), None)
            self.grads_in.pop((v, m), None)

    def result(self) -> ScheduleRun:
        self.run.grads = {n: g / self.M for n, g in self.run.grads.items()}
        return self.run


class _DistExecutor(_Executor):
    """One rank of a ``torch.distributed`` group (gloo): transfers to other ranks are ``isend`` / ``recv`` with
    the tag of (stage, microbatch, direction), so messages match whatever order the ranks post them in."""

    def __init__(self, *a):
        super().__init__(*a)
        self.pending: list = []

    def send(self, store, key, value, src, dst, tag):
        if src == dst:
            store[key] = value
            return

        value = value.contiguous()
        self.pending.append((dist.isend(value, dst, tag=tag), value))
        self.run.sends += 1

    def receive(self, store, key, src, dst, tag, like):
        if key in store:
            return store[key]

        buf = torch.empty([d.size for d in like.shape], dtype=like.dtype)
        t0 = time.perf_counter()
        dist.recv(buf, src, tag=tag)
        self.run.wait_s += time.perf_counter() - t0
        store[key] = buf
        return buf

    def result(self):
        t0 = time.perf_counter()
        for work, _ in self.pending:
            work.wait()
        self.run.wait_s += time.perf_counter() - t0
        return super().result()


def run_schedule(table: ScheduleTable, programs: list[StageProgram], ids: torch.Tensor,
                 targets: torch.Tensor) -> ScheduleRun:
    """Run one step's forward and backward passes of every rank in ``table``'s order, in this process: step by
    step through :attr:`~meshtorch.core.schedules.ScheduleTable.timed`, nothing on idle steps.

    Args:
        table: the schedule (its ``S R`` must be ``len(programs)``).
        programs: :func:`stage_programs` (same ``M``).
        ids, targets: int64 ``[batch, length]``; microbatch ``m`` is rows ``m B/M .. (m+1) B/M - 1``.

    Returns:
        :class:`ScheduleRun`; the gradients are accumulated over microbatches and divided by ``M``.

    Raises:
        ValueError: ``len(programs)`` is not the table's virtual stages.
    """
    ex = _Executor(table, programs, ids, targets)
    for row in table.timed:
        for r, a in enumerate(row):
            if a is not None:
                ex.execute(a, r)
    return ex.result()


def run_rank(table: ScheduleTable, programs: list, ids: torch.Tensor, targets: torch.Tensor) -> ScheduleRun:
    """This process's rank (``torch.distributed.get_rank()``, a group of ``table.stages`` processes, gloo) runs
    its actions ``table.order[rank]`` in order, receiving activations and gradients from the neighbouring ranks
    when it needs them (``programs``: :func:`stage_programs` with ``rank``; ``ids``/``targets`` the full batch,
    read on the first and last stage only). Returns its :class:`ScheduleRun` (loss on the last stage's rank)."""

    r = dist.get_rank()
    if dist.get_world_size() != table.stages:
        raise ValueError(f"run_rank: {dist.get_world_size()} processes for {table.stages} pipeline ranks.")
    ex = _DistExecutor(table, programs, ids, targets)
    for a in table.order[r]:
        ex.execute(a, r)
    out = ex.result()
    if table.rank_of(table.virtual_stages - 1) != r:
        out.loss = None
    return out
