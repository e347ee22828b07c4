"""Gradient accumulation: ``N`` microbatches per optimizer step, gradients summed in place.

One optimizer step over a batch of ``B`` rows is split into ``N`` runs over microbatches of ``B / N``
rows (``torch``'s ``loss / N; loss.backward()`` N times, then ``optimizer.step()``; Megatron's and
DeepSpeed's ``gradient_accumulation_steps``). Each microbatch's forward and backward run to completion
before the next one starts (they are separate runs of the same graph), so the activation peak is that
of one microbatch; what is added is one accumulator per trainable variable (float32, the variable's
named shape, hence its storage layout: sharded like the variable under FSDP storage rules).

:func:`accumulated_updates` builds, on the graph of a microbatch's loss, three fetch lists:

* ``first`` (microbatch 1): ``acc <- g`` (an assignment, written into the accumulator's storage);
* ``middle`` (microbatches 2 .. N-1): ``acc <- acc + g``, one :class:`AccumulateGradient` per variable
  that adds in place into the accumulator (:mod:`meshtorch.lowering.donate`), so each microbatch
  gradient is freed as soon as it is added;
* ``last`` (microbatch N): the optimizer's updates (and ``--clip-norm``'s clipping) applied to
  ``acc + g`` (added in place), and nothing reset: the next step's ``first`` overwrites the accumulator.

``g`` is the gradient of ``loss / N``, so the summed gradient is the mean over the N microbatches:
the gradient of the mean loss of the whole batch (equal microbatches), and the losses and updates are
those of one step on the whole batch to float32 rounding.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from meshtorch.autodiff import gradients
from meshtorch.core.graph import Graph, Tensor
from meshtorch.core.scopes import VariableScope, variable_scope
from meshtorch.ops._kernels import align_spec, aligned
from meshtorch.ops.initializers import zeros_initializer
from meshtorch.ops.variables import Assign, get_variable
from meshtorch.optim.clip import clip_by_global_norm
from meshtorch.optim.fused import UpdateOperation
from meshtorch.optim.in_backward import mark_in_backward, per_variable

__all__ = ["ACCUMULATOR_SUFFIX", "AccumulateGradient", "AccumulatedUpdates", "accumulated_updates",
           "build_training_graph"]

#: an accumulator is the non-trainable float32 variable ``<variable name>/accumulated_gradient``
ACCUMULATOR_SUFFIX = "accumulated_gradient"


def _k_accumulate(acc, g, *, align, donate: bool = False):
    """``acc + g`` of one slice in float32: added into ``acc`` when the plan donates it (no later reader)."""
    g = aligned(g, align)
    if donate and acc.dtype == torch.float32 and acc.is_contiguous() and not torch.compiler.is_compiling():
        return acc.add_(g)
    return acc + g.to(acc.dtype)


_k_accumulate.donates = (0,)  # the accumulator may be updated in place (meshtorch.lowering.donate)
_k_accumulate.fresh_outputs = True  # without donate=True the output is a new tensor


class AccumulateGradient(UpdateOperation):
    """``acc + g``: an accumulator (float32, shape ``S``) plus a gradient (the dims of ``S``, any order).

    Output: float32, shape ``S``. Built in the storage scope, so under storage rules the gradient (a partial
    sum) is reduce-scattered into the accumulator's shards. Not differentiable.
    """

    def __init__(self, acc: Tensor, grad: Tensor, name: str | None = None):
        super().__init__([acc, grad], name=name or "accumulate_gradient")
        self.outputs = [Tensor(self, acc.shape, torch.float32)]

    def lower(self, lw):
        acc, grad = self.inputs
        kernel = functools.partial(_k_accumulate, align=align_spec(grad.shape, acc.shape))
        lw.set(self.outputs[0], lw.slicewise(kernel, lw.get(acc), lw.get(grad)))


@dataclass
class AccumulatedUpdates:
    """The fetch lists of one accumulated optimizer step (see the module docstring).

    ``first``: assignments ``acc <- g`` (microbatch 1); ``middle``: assignments ``acc <- acc + g``
    (microbatches 2 .. N-1); ``last``: the optimizer's assignments from ``acc + g`` (microbatch N);
    ``accumulators``: the accumulator variables' value tensors, in ``graph.trainable_variables`` order;
    ``grads``: the summed (mean) gradients the optimizer sees.
    """

    microbatches: int
    first: list
    middle: list
    last: list
    accumulators: list
    grads: list

    def fetches(self, k: int) -> list:
        """The assignments to fetch with microbatch ``k`` (0-based) of a step."""
        if k == self.microbatches - 1:
            return self.last
        return self.first if k == 0 else self.middle


def accumulated_updates(graph: Graph, loss: Tensor, optimizer, microbatches: int,
                        clip_norm: float | None = None) -> AccumulatedUpdates:
    """Build gradient accumulation over ``microbatches`` N >= 2 runs for every trainable variable of ``graph``.

    Args:
        graph: the graph of one microbatch (its placeholders hold ``B / N`` rows).
        loss: the scalar loss of one microbatch (a mean over its rows); the gradients are those of ``loss / N``.
        optimizer: a :mod:`meshtorch.optim` optimizer, applied once per N microbatches to the summed gradients.
        clip_norm: clip the summed gradients to this global norm before the optimizer (``--clip-norm``).

    Returns:
        an :class:`AccumulatedUpdates`.

    Raises:
        ValueError: ``microbatches`` < 2 (one microbatch: use the optimizer's ``apply_grads`` directly).
    """
    if not isinstance(microbatches, int) or microbatches < 2:
        raise ValueError(f"accumulated_updates: microbatches must be an int >= 2, got {microbatches!r}.")
    variables = graph.trainable_variables
    grads = gradients([loss * (1.0 / microbatches)], variables)
    first, middle, written, accs, sums = [], [], [], [], []
    for g, v in zip(grads, variables, strict=True):
        if g is None:
            sums.append(None)
            continue
        with variable_scope(VariableScope("")):  # named after the variable wherever this is called
            acc = get_variable(v.mesh, f"{v.name}/{ACCUMULATOR_SUFFIX}", v.shape,
                               initializer=zeros_initializer(), dtype=torch.float32, trainable=False)
        acc.operation.transient = True  # scratch, not state: checkpoints leave it out (checkpoint.format)
        accs.append(acc)
        with graph.storage_scope():
            first.append(Assign([acc.operation], [g], name="accumulate_first"))
            middle.append(Assign([acc.operation], [AccumulateGradient(acc, g).outputs[0]], name="accumulate"))
            total = AccumulateGradient(acc, g).outputs[0]
            # written back too (in place already when donated: the commit copies nothing), so after a step the
            # accumulator holds that step's summed gradient under every layout
            written.append(Assign([acc.operation], [total], name="accumulate_last"))
        sums.append(total)
    clipped = sums
    if clip_norm:
        clipped, _ = clip_by_global_norm(sums, clip_norm)
    last = list(optimizer.apply_grads(clipped, variables)) + written
    return AccumulatedUpdates(microbatches, first, middle, last, accs, clipped)


def build_training_graph(builder, config, optimizer, microbatches: int = 1, clip_norm: float | None = None,
                         in_backward: bool = False, **build_kwargs):
    """A model's training graph with ``optimizer`` applied once per ``microbatches`` N runs: what ``meshtorch train``
    runs and ``meshtorch plan`` plans (one function, so the two agree).

    Args:
        builder: ``builder(config, optimizer=..., clip_norm=..., **build_kwargs)`` -> a graph with ``graph``,
            ``loss`` and ``updates`` (e.g. :func:`meshtorch.models.transformer.build_lm`).
        config: a dataclass with ``batch_size`` B (the whole batch of one optimizer step).
        microbatches: N dividing B; N > 1 builds the graph of one microbatch (``batch_size`` B / N) without an
            optimizer and sets its ``updates`` to the last microbatch's (:func:`accumulated_updates`, with
            ``clip_norm``).
        in_backward: optimizer-in-backward (:mod:`meshtorch.optim.in_backward`): one update op per variable, each
            run as soon as its gradient is final.

    Returns:
        ``(graph object, AccumulatedUpdates or None for N = 1)``.

    Raises:
        ValueError: ``in_backward`` with ``clip_norm`` or with N > 1, in one line.
    """
    if in_backward and (clip_norm or microbatches > 1):
        why = ("gradient clipping needs every gradient's norm before any update (set the clip norm to 0)"
               if clip_norm else f"gradient accumulation applies the optimizer once per {microbatches} microbatches")
        raise ValueError(f"optimizer-in-backward is refused with {why}.")
    if microbatches == 1:
        lm = builder(config, optimizer=per_variable(optimizer) if in_backward else optimizer, clip_norm=clip_norm,
                     **build_kwargs)
        if in_backward:
            mark_in_backward(lm.updates)
        return lm, None
    lm = builder(dataclasses.replace(config, batch_size=config.batch_size // microbatches), **build_kwargs)
    acc = accumulated_updates(lm.graph, lm.loss, optimizer, microbatches, clip_norm=clip_norm)
    lm.updates = acc.last
    return lm, acc
