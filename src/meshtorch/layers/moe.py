"""Mixture-of-Experts feed-forward layer with top-k gating and expert capacity (GShard).

Follows Mesh TF ``transformer/moe.py`` (``transformer_moe_layer_v1`` and ``_top_2_gating``):
Shazeer et al. 2017 ("Outrageously Large Neural Networks") and Lepikhin et al. 2020 (GShard,
section 2.2 and Algorithm 1).

Tokens are routed within *groups*: ``x`` is ``[group, tokens, d_model]`` (in the LM the group dim
is ``batch`` and the tokens dim ``length``: every sequence is a group). Per group each expert
accepts at most ``capacity`` tokens; positions are handed out in token order, first to the tokens'
first choices, then to their second choices (Mesh TF); a token that finds its expert full is
dropped *for that expert* (its output gets no contribution from it).

Dimension names (the layout language talks about these):

* ``experts`` (``experts_dim``): the expert weights ``[experts, d_model, d_ff]`` and
  ``[experts, d_ff, d_model]`` and the expert-side activations ``[experts, expert_<group>,
  expert_capacity, ...]``. May be split (expert parallelism).
* ``experts_unsplit``: the router ``[d_model, experts_unsplit]`` and the gating tensors
  ``[group, tokens, experts_unsplit(, expert_capacity)]``. Mesh TF's name; normally not split.
* ``expert_<group>`` (e.g. ``expert_batch``): the group dim as the experts see it.

The dispatched tokens are computed as ``[experts_unsplit, group, expert_capacity, d_model]`` (an
einsum with the dispatch tensor; local wherever ``group`` is split) and then *reshaped* to
``[experts, expert_<group>, expert_capacity, d_model]``. That reshape is where the layout decides the
communication (``meshtorch.ops.reshape`` rules):

* ``batch:a;experts:a`` (GShard's layout): the split moves from the group dim to the experts dim:
  one **all-to-all** over ``a`` for the dispatch and one for the combine (and one each in the
  backward pass); no all-gather of the token tensor;
* ``experts:a`` alone: a free local slice in, an all-gather out;
* ``batch:a`` alone: the groups are gathered for the experts unless ``expert_batch`` is split the
  same way (add ``expert_batch:a`` to the layout: then the reshape is free, plain data parallelism);
  likewise ``batch:rows;experts:cols`` wants ``expert_batch:rows``.

The auxiliary load-balancing loss (Mesh TF / GShard): per group, ``E * sum_e mean_tokens(gates_e) *
fraction of tokens whose first choice is e`` (before capacity), averaged over groups; it is 1 for
perfectly uniform routing.

Causality: first choices are served before second choices, so a later token's first choice can
displace an earlier token's second choice (as in GShard / Mesh TF): in a decoder, a token's output
depends slightly on later tokens unless nothing is dropped (or ``top_k=1``).

Differences from Mesh TF: the second expert is always used if it fits (Mesh TF's ``"all"``
second-expert policy; its default ``"random"`` policy is not implemented); ``top_k`` may be any
k >= 1 (k = 1 keeps the raw gate, as Switch Transformer; k >= 2 renormalises the k gates); ties in
the router probabilities pick the lowest expert index.
"""

from __future__ import annotations

import torch

from meshtorch.core.dims import Dimension, Shape, convert_to_dimension
from meshtorch.core.errors import ShapeError
from meshtorch.core.graph import Tensor
from meshtorch.layers.feedforward import _ACTIVATIONS
from meshtorch.ops import elementwise as ew
from meshtorch.ops.binary import less
from meshtorch.ops.einsum import einsum
from meshtorch.ops.indexing import one_hot
from meshtorch.ops.initializers import VarianceScalingInitializer
from meshtorch.ops.reduce import reduce_mean, reduce_sum, softmax
from meshtorch.ops.reshape import reshape
from meshtorch.ops.selection import top_1
from meshtorch.ops.sequence import cumsum
from meshtorch.ops.variables import get_variable

__all__ = ["moe_ffn", "moe_apply", "expert_capacity", "top_k_gating"]


def expert_capacity(tokens_per_group: int, num_experts: int, capacity_factor: float,
                    min_expert_capacity: int = 4) -> int:
    """Tokens each expert accepts per group (Mesh TF ``transformer_moe_layer_v1``).

    ``min(tokens, max(min_expert_capacity, int(tokens * capacity_factor / num_experts)))``.

    Raises:
        ValueError: if ``capacity_factor`` <= 0 or ``min_expert_capacity`` < 1.
    """
    if capacity_factor <= 0:
        raise ValueError(f"expert_capacity: capacity_factor must be > 0, got {capacity_factor}.")
    if min_expert_capacity < 1:
        raise ValueError(f"expert_capacity: min_expert_capacity must be >= 1, got {min_expert_capacity}.")
    return min(tokens_per_group, max(min_expert_capacity, int(tokens_per_group * capacity_factor / num_experts)))


def top_k_gating(gates: Tensor, tokens_dim: Dimension, experts_dim: Dimension, capacity_dim: Dimension,
                 top_k: int = 2):
    """Dispatch and combine tensors and the load-balancing loss from router probabilities.

    Args:
        gates: ``[group..., tokens, experts]`` softmax probabilities over ``experts_dim``.
        tokens_dim: the dim along which positions in an expert are handed out (in order).
        experts_dim: the experts dim of ``gates`` (``experts_unsplit`` in :func:`moe_ffn`).
        capacity_dim: ``expert_capacity``: its size is the per-expert capacity per group.
        top_k: experts per token.

    Returns:
        ``(dispatch, combine, aux_loss)``: ``dispatch`` ``[group..., tokens, experts, capacity]`` is
        1.0 where a token takes a slot (no gradient); ``combine`` is the same times the token's
        gate for that expert (differentiable w.r.t. ``gates``); ``aux_loss`` a scalar.
    """
    e = experts_dim.size
    remaining = gates
    choices = []  # (gate, index, mask)
    for i in range(top_k):
        g, idx = top_1(remaining, experts_dim, name=f"top{i + 1}")
        mask = one_hot(idx, experts_dim, dtype=gates.dtype, name=f"expert_mask{i + 1}")
        choices.append((g, idx, mask))
        if i + 1 < top_k:
            remaining = remaining * (1.0 - mask)
    density = reduce_mean(choices[0][2], reduced_dim=tokens_dim)  # fraction of first choices per expert
    proxy = reduce_mean(gates, reduced_dim=tokens_dim)  # mean gate per expert
    aux_loss = reduce_mean(proxy * density) * float(e * e)
    if top_k > 1:
        denom = choices[0][0]
        for g, _, _ in choices[1:]:
            denom = denom + g
        denom = denom + 1e-9
    filled = None  # [group..., experts]: slots taken by earlier choices
    dispatch = combine = None
    cap = float(capacity_dim.size)
    for g, _idx, mask in choices:
        pos = cumsum(mask, tokens_dim, exclusive=True)
        if filled is not None:
            pos = pos + filled
        pos = pos * mask
        mask = mask * ew.cast(less(pos, cap), gates.dtype)  # drop what does not fit
        filled = reduce_sum(mask, reduced_dim=tokens_dim) if filled is None else \
            filled + reduce_sum(mask, reduced_dim=tokens_dim)
        slot = one_hot(ew.cast(reduce_sum(pos, reduced_dim=experts_dim), torch.int64), capacity_dim,
                       dtype=gates.dtype)
        d = mask * slot  # [group..., tokens, experts, capacity]
        w = g / denom if top_k > 1 else g
        c = d * w
        dispatch = d if dispatch is None else dispatch + d
        combine = c if combine is None else combine + c
    return ew.stop_gradient(dispatch), combine, aux_loss


def moe_ffn(x: Tensor, experts_dim, hidden_dim, capacity_factor: float = 1.25, top_k: int = 2,
            min_expert_capacity: int = 4, activation: str = "relu", name: str | None = None):
    """Mixture-of-Experts feed-forward layer (GShard top-2 gating; Mesh TF ``transformer_moe_layer_v1``).

    Args:
        x: ``[group, tokens, d_model]`` float (``d_model`` last; e.g. ``[batch, length, d_model]``).
        experts_dim: Dimension ``experts`` (number of experts); may be split over a mesh axis.
        hidden_dim: Dimension ``d_ff`` of each expert (may be split).
        capacity_factor, min_expert_capacity: per-expert capacity per group, see :func:`expert_capacity`.
        top_k: experts per token (2 = GShard).
        activation: relu, gelu, gelu_tanh, silu or linear.
        name: variable scope. Variables: ``{name}/router/kernel`` ``[d_model, experts_unsplit]``,
            ``{name}/wi/kernel`` ``[experts, d_model, d_ff]``, ``{name}/wo/kernel``
            ``[experts, d_ff, d_model]`` (variance scaling, fan-in d_model resp. d_ff, normal).

    Returns:
        ``(y, aux_loss)``: ``y`` of x's shape and dtype; ``aux_loss`` a scalar load-balancing loss
        (add ``coef * aux_loss`` to the training loss; GShard uses coef 1e-2).

    Raises:
        ShapeError: if x is not 3-D, or a dim name is already taken.
        ValueError: on a bad ``top_k``, ``activation`` or capacity setting.
    """
    if x.shape.ndims != 3:
        raise ShapeError(f"moe_ffn: x {x.name!r} {x.shape} must be [group, tokens, d_model] (3 dims).")
    if activation not in _ACTIVATIONS:
        raise ValueError(f"moe_ffn: activation {activation!r} is not one of {sorted(_ACTIVATIONS)}.")
    experts, hidden = convert_to_dimension(experts_dim), convert_to_dimension(hidden_dim)
    if not 1 <= top_k <= experts.size:
        raise ValueError(f"moe_ffn: top_k must be in [1, {experts.size}] (the number of experts), got {top_k}.")
    group, tokens, d_model = x.shape.dims
    experts_u = Dimension(f"{experts.name}_unsplit", experts.size)
    name = x.graph.unique_name(name or "moe")
    dtype = x.dtype
    router = get_variable(x.mesh, f"{name}/router/kernel", [d_model, experts_u], dtype=dtype,
                          initializer=VarianceScalingInitializer(1.0, "fan_in", "normal", [d_model], [experts_u]))
    wi = get_variable(x.mesh, f"{name}/wi/kernel", [experts, d_model, hidden], dtype=dtype,
                      initializer=VarianceScalingInitializer(1.0, "fan_in", "normal", [d_model], [hidden]))
    wo = get_variable(x.mesh, f"{name}/wo/kernel", [experts, hidden, d_model], dtype=dtype,
                      initializer=VarianceScalingInitializer(1.0, "fan_in", "normal", [hidden], [d_model]))
    capacity = expert_capacity(tokens.size, experts.size, capacity_factor, min_expert_capacity)
    return moe_apply(x, router, wi, wo, capacity, top_k, activation, name)


def moe_apply(x: Tensor, router: Tensor, wi: Tensor, wo: Tensor, capacity: int, top_k: int = 2,
              activation: str = "relu", name: str | None = None):
    """The computation of :func:`moe_ffn` with given weights (no variables created).

    Args:
        x: ``[group, tokens, d_model]``.
        router: ``[d_model, experts_unsplit]``; wi: ``[experts, d_model, d_ff]``; wo: ``[experts, d_ff, d_model]``
            (``experts_unsplit`` is named ``<experts>_unsplit`` and has the size of ``experts``).
        capacity: slots per expert per group (size of the ``expert_capacity`` dim).
        top_k, activation: as :func:`moe_ffn`.

    Returns:
        ``(y, aux_loss)`` as :func:`moe_ffn`.

    Raises:
        ShapeError: naming the tensor, if a weight has the wrong dims.
        ValueError: on a bad ``top_k``, ``capacity`` or ``activation``.
    """
    if x.shape.ndims != 3:
        raise ShapeError(f"moe: x {x.name!r} {x.shape} must be [group, tokens, d_model] (3 dims).")
    if activation not in _ACTIVATIONS:
        raise ValueError(f"moe: activation {activation!r} is not one of {sorted(_ACTIVATIONS)}.")
    group, tokens, d_model = x.shape.dims
    if wi.shape.ndims != 3 or wi.shape[1] != d_model:
        raise ShapeError(f"moe: wi {wi.name!r} {wi.shape} must be [experts, {d_model.name}, d_ff].")
    experts, _, hidden = wi.shape.dims
    experts_u = Dimension(f"{experts.name}_unsplit", experts.size)
    for w, want in ((router, Shape([d_model, experts_u])), (wo, Shape([experts, hidden, d_model]))):
        if w.shape != want:
            raise ShapeError(f"moe: weight {w.name!r} {w.shape} must have shape {want}.")
    if not 1 <= top_k <= experts.size:
        raise ValueError(f"moe: top_k must be in [1, {experts.size}] (the number of experts), got {top_k}.")
    if not 1 <= capacity <= tokens.size:
        raise ValueError(f"moe: capacity must be in [1, {tokens.size}] (tokens per group), got {capacity}.")
    group_e = Dimension(f"expert_{group.name}", group.size)
    cap = Dimension("expert_capacity", capacity)
    for d in (experts, experts_u, group_e, cap, hidden):
        if d.name in x.shape:
            raise ShapeError(f"moe: x {x.name!r} {x.shape} already has a dimension named {d.name!r}, which the "
                             "layer needs for itself; rename it.")
    name = name or "moe"
    dtype = x.dtype
    xf = ew.cast(x, torch.float32)
    logits = einsum([xf, ew.cast(router, torch.float32)], output_shape=[group, tokens, experts_u],
                    name=f"{name}/router")
    gates = softmax(logits, experts_u)
    dispatch, combine, aux_loss = top_k_gating(gates, tokens, experts_u, cap, top_k)
    dispatch, combine = ew.cast(dispatch, dtype), ew.cast(combine, dtype)
    # [experts_unsplit, group, capacity, d_model]: local wherever group is split
    expert_in = einsum([x, dispatch], output_shape=[experts_u, group, cap, d_model], name=f"{name}/dispatch")
    # move the split from group to experts (an all-to-all when both share a mesh axis)
    expert_in = reshape(expert_in, Shape([experts, group_e, cap, d_model]), name=f"{name}/to_experts")
    h = einsum([expert_in, wi], output_shape=[experts, group_e, cap, hidden], name=f"{name}/wi")
    h = _ACTIVATIONS[activation](h)
    expert_out = einsum([h, wo], output_shape=[experts, group_e, cap, d_model], name=f"{name}/wo")
    expert_out = reshape(expert_out, Shape([experts_u, group, cap, d_model]), name=f"{name}/from_experts")
    y = einsum([expert_out, combine], output_shape=x.shape, name=f"{name}/combine")
    return y, ew.cast(aux_loss, dtype)

