"""The LM cut into one program per virtual stage, for a pipeline schedule table (issue 32).

Virtual stage ``v`` of ``V = S R`` (on rank ``v mod S``)
is its own meshtorch graph, lowered with the layout of the mesh *inside* a stage (data, model, storage rules):
stage 0 the embeddings and layer 0, stage ``v`` layer ``v``, the last stage also the final norm, logits and the
microbatch's mean loss. Each graph holds, besides its forward output, the gradient programs
(:func:`meshtorch.autodiff.gradients` with an upstream-gradient placeholder): with respect to its input (``I``)
and to its weights (``W``); ``B`` runs both; with an optimizer also the update program, which applies
the optimizer (:mod:`meshtorch.optim`, as ``build_lm``'s ``training_updates``) to gradients fed from outside
(summed over the microbatches, optionally scaled by a clipping coefficient). The executor that runs these
programs in a schedule's order is :mod:`meshtorch.runtime.pipeline_exec`.

The forward run stashes the activations the gradient programs read from it (``saved``: the slots
:meth:`~meshtorch.lowering.Lowering.stash_slots` finds, what autodiff saved) and every gradient run is given them
(:meth:`~meshtorch.lowering.Lowering.run_stashed`), so no gradient program recomputes the forward pass; a
zero-bubble ``I`` likewise stashes the activation gradients its ``W`` reads (``saved_grads``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from meshtorch.autodiff import gradients
from meshtorch.core.graph import Graph, Mesh
from meshtorch.core.mesh_spec import MeshSpec
from meshtorch.core.pipeline import LM_STACKED_NAMES
from meshtorch.layers import softmax_cross_entropy_with_logits
from meshtorch.lowering import Lowering
from meshtorch.models.transformer import LMConfig, _block, _embeddings, dims, lm_logits
from meshtorch.ops.reduce import reduce_mean
from meshtorch.ops.variables import placeholder

__all__ = ["StageParts", "StageProgram", "native_parts", "stage_programs"]


@dataclass(frozen=True)
class StageParts:
    """The pieces of a decoder-only LM that :func:`stage_programs` cuts into stages: ``dims`` (name ->
    Dimension of one microbatch's config), ``embed(mesh, ids) -> x`` ``[batch, length, d_model]``, ``block(x, i)``
    (layer ``i``, variables named per layer), ``logits(mesh, x) -> [batch, length, vocab]`` (final norm and
    head), the per-layer / stacked naming ``stacked_names``, ``z_loss``, and the graphs' ``legacy_names``."""

    dims: dict
    embed: Callable
    block: Callable
    logits: Callable
    stacked_names: object = LM_STACKED_NAMES
    z_loss: float = 0.0
    legacy_names: dict = field(default_factory=dict)


def native_parts(c: LMConfig) -> StageParts:
    """The native LM's :class:`StageParts` (``build_lm``'s embeddings, blocks and ``lm_logits``).

    Raises:
        ValueError: label smoothing (not supported by the stage programs)."""
    if c.label_smoothing:
        raise ValueError("stage_programs: label smoothing is not supported.")
    d = dims(c)
    return StageParts(d, lambda mesh, ids: _embeddings(mesh, ids, d), lambda x, i: _block(c, d, x, f"layer_{i}",
                                                                                        False, []),
                      lambda mesh, x: lm_logits(c, d, x), LM_STACKED_NAMES, c.z_loss)


@dataclass
class StageProgram:
    """Virtual stage ``stage``'s lowered programs: ``inputs`` (ids on stage 0, else the hidden state
    ``[batch/M, length, d_model]``), ``output`` (hidden state, or the microbatch's mean loss on the last stage),
    ``output_grad`` (placeholder of the upstream gradient; None on the last stage), ``input_grad`` (None on
    stage 0), ``weights`` and ``weight_grads`` (by variable name), ``targets`` (last stage); with an optimizer
    ``grad_feeds`` (by variable name: the placeholder of the gradient the update applies), ``clip_coefficient``
    (float32 ``[]`` placeholder multiplying them, or None) and ``updates`` (the optimizer's assign ops);
    ``saved``: the lowering's slots the forward run stashes for the gradient runs (activations autodiff saved);
    ``saved_grads``: the slots an ``I`` run stashes for the ``W`` run (activation gradients inside the stage)."""

    stage: int
    lowering: Lowering
    inputs: object
    output: object
    output_grad: object | None
    input_grad: object | None
    weights: dict
    weight_grads: dict
    targets: object | None = None
    grad_feeds: dict = field(default_factory=dict)
    clip_coefficient: object | None = None
    updates: list = field(default_factory=list)
    saved: tuple = ()
    saved_grads: tuple = ()


def stage_programs(config: LMConfig, stages: int, microbatches: int, repeats: int = 1, mesh_shape: str = "",
                   layout: str = "", storage: str = "", seed: int = 0, rank: int | None = None,
                   optimizer: Callable | None = None, clip: bool = False, mode: str = "codegen",
                   compile_backend: str = "inductor", parts: Callable = native_parts) -> list:
    """The ``V = stages x repeats`` virtual stages of the unpipelined LM ``config`` (``num_layers`` a multiple of
    ``V``: stage ``v`` runs layers ``v L/V .. (v+1) L/V - 1``), each a graph of one microbatch (``batch_size /
    microbatches`` sequences) lowered on ``MeshSpec(mesh_shape, layout, storage)``. Variables keep the
    unpipelined LM's names (``embedding``, ``layer_{i}/...``, ``final_norm/...``, ``logits/kernel``) and so, drawn
    from ``seed`` by name, its initial values.
    ``rank``: build only that rank's virtual stages (``v mod stages == rank``; None in the other entries).
    ``optimizer``: a function returning a fresh :mod:`meshtorch.optim` optimizer (one per stage graph, as
    ``meshtorch.runtime.optimizers.make_optimizer``); each stage then has update ops applying it to its
    ``grad_feeds`` (times ``clip_coefficient`` with ``clip``). Its slots and ``global_step`` take the names
    ``build_lm(optimizer=...)`` gives them, so the stages' variables together are the unpipelined LM's.
    ``mode``, ``compile_backend``: the :class:`~meshtorch.lowering.Lowering`'s executor (``codegen``, ``interpret``,
    ``compile``) and ``torch.compile`` backend. ``parts``: the model's :class:`StageParts` from its (microbatch's)
    config: :func:`native_parts` (an ``LMConfig``), :func:`meshtorch.models.hf.stage_parts` (an imported model's
    ``HFModelConfig``; its variables are then ``embed``, ``layers{i}/...``, ``final_norm/...``, ``lm_head``).

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
    if getattr(config, "dropout", 0) > 0:
        raise ValueError("stage_programs: dropout > 0 is not supported (the stage programs are separate runs, "
                         "whose random draws differ from the unpipelined step's); set dropout=0.")
    if getattr(config, "num_experts", 0) > 0:
        raise ValueError("stage_programs: MoE layers are not supported (their load-balancing loss would have to "
                         "leave every stage); set num_experts=0.")
    c = replace(config, batch_size=config.batch_size // microbatches)
    P = parts(c)
    d = P.dims
    out = []
    for v in range(V):
        if rank is not None and v % stages != rank:
            out.append(None)
            continue
        graph = Graph(seed=seed)
        graph.stacked_names = P.stacked_names  # a pipeline layout's (stacked) checkpoint restores too
        graph.legacy_names = P.legacy_names
        mesh = Mesh(graph, "mesh")
        if v == 0:
            inputs = placeholder(mesh, "inputs", [d["batch"], d["length"]], dtype=torch.int64)
            x = P.embed(mesh, inputs)
        else:
            inputs = placeholder(mesh, "stage_input", [d["batch"], d["length"], d["d_model"]])
            x = inputs
        y = x
        for i in range(v * per, (v + 1) * per):
            y = P.block(y, i)
        targets = None
        if v == V - 1:  # as build_lm's head
            targets = placeholder(mesh, "targets", [d["batch"], d["length"]], dtype=torch.int64)
            y = reduce_mean(softmax_cross_entropy_with_logits(P.logits(mesh, y), targets, d["vocab"],
                                                              z_loss=P.z_loss), name="loss")
        weights = {w.name: w for w in graph.trainable_variables}
        dy = None if v == V - 1 else placeholder(mesh, "stage_output_grad", y.shape)
        names = list(weights)
        grads = gradients([y], ([inputs] if v else []) + [weights[n] for n in names],
                          grad_ys=None if dy is None else [dy])
        gin, gw = (grads[0], grads[1:]) if v else (None, grads)
        feeds, coef, updates = {}, None, []
        if optimizer is not None:
            feeds = {n: placeholder(mesh, f"{n}/accumulated_grad", weights[n].shape) for n in names}
            coef = placeholder(mesh, "clip_coefficient", []) if clip else None
            updates = optimizer().apply_grads([feeds[n] if coef is None else feeds[n] * coef for n in names],
                                              [weights[n] for n in names])
        lw = Lowering(graph, {mesh: MeshSpec(mesh_shape, layout, storage=storage or None)}, mode=mode,
                      compile_backend=compile_backend)
        saved = lw.stash_slots([y], ([gin] if v else []) + list(gw))
        saved_grads = lw.stash_slots([gin], list(gw), given=saved) if v else ()
        out.append(StageProgram(v, lw, inputs, y, dy, gin, weights, dict(zip(names, gw, strict=True)), targets,
                                feeds, coef, updates, saved, saved_grads))
    return out
