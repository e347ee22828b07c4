"""Mixture-of-Experts transformer layer (Mesh TF ``transformer/moe.py`` ``MoE1D``) on meshtorch's MoE layer.

``MoE1D`` keeps Mesh TF's constructor and variable names inside its scope
(``<model>/block_000/layer_001/MoE1D/``): ``top_2_gating/kernel`` ``[d_model, experts_unsplit]``,
``wi/kernel`` ``[experts, d_model, expert_hidden]``, ``wo/kernel`` ``[experts, expert_hidden,
d_model]``; the load-balancing loss times ``loss_coef`` is appended to the context's losses.

The routing is :func:`meshtorch.layers.moe.moe_apply` (GShard top-2; see ``docs/moe.md``), which
differs from Mesh TF's ``transformer_moe_layer_v1`` in these documented ways: every sequence is a
group (Mesh TF regroups batch x length into groups of ``group_size`` tokens, so ``group_size`` is
ignored); the second expert is always used when it has room (Mesh TF's ``second_policy`` "random"
drops it with a probability; its default ``"random"`` runs as ``"all"``, with a warning); the router
dim is ``experts_unsplit`` (Mesh TF: ``expert_unsplit``); no padding weighting of the balancing loss. Gating other than
``top_2`` raises NotImplementedError.
"""

from __future__ import annotations

import warnings

from meshtorch.layers.moe import expert_capacity, moe_apply
from meshtorch.transformer import _mtf as mtf
from meshtorch.transformer._context import TransformerLayer

__all__ = ["MoE1D"]


class MoE1D(TransformerLayer):
    """Mixture of Experts feed-forward layer (Mesh TF ``moe.MoE1D``; same constructor arguments).

    Raises:
        NotImplementedError: ``moe_gating`` other than ``"top_2"``, a ``second_policy`` other than
            ``"all"``, ``output_dim``, ``use_experts_attention``, ``z_loss`` or ``word_embed_mode``
            (not ported); an ensemble model.
    """

    def __init__(self, num_experts=16, loss_coef=1e-2, hidden_size=4096, group_size=1024, capacity_factor_train=1.25,
                 capacity_factor_eval=2.0, use_second_place_loss=False, second_policy_train="random",
                 second_policy_eval="random", second_threshold_train=0.2, second_threshold_eval=0.2, dropout_rate=0.0,
                 activation="relu", moe_gating="top_2", min_expert_capacity=4, switch_policy_train="input_jitter",
                 switch_policy_eval="input_jitter", switch_dropout=0.1, switch_temperature=1.0, switch_jitter=1e-2,
                 ntlb_top_k=4, output_dim=None, use_experts_attention=False, z_loss=None, word_embed_mode=None,
                 use_second_place_expert_prob=None, use_second_place_expert_prob_temp=None,
                 top_n_num_experts_per_token=3):
        if "random" in (second_policy_train, second_policy_eval):
            warnings.warn("MoE1D: second_policy 'random' (Mesh TF's default) is run as 'all': meshtorch always sends "
                          "a token to its second expert when that expert has room.", stacklevel=2)
            second_policy_train = second_policy_eval = "all"
        unported = {"moe_gating": (moe_gating, "top_2"), "second_policy_train": (second_policy_train, "all"),
                    "second_policy_eval": (second_policy_eval, "all"), "output_dim": (output_dim, None),
                    "use_experts_attention": (use_experts_attention, False), "z_loss": (z_loss, None),
                    "word_embed_mode": (word_embed_mode, None), "use_second_place_loss": (use_second_place_loss, False)}
        for arg, (val, ok) in unported.items():
            if val != ok:
                raise NotImplementedError(f"MoE1D: {arg}={val!r} is not ported to meshtorch (supported: {ok!r}); "
                                          "see meshtorch.transformer.moe's docstring.")
        if activation not in ("relu", "gelu", "linear"):
            raise NotImplementedError(f"MoE1D: activation {activation!r} is not ported (relu, gelu, linear).")
        self.num_experts = num_experts
        self.loss_coef = loss_coef
        self.hidden_size = hidden_size
        self.group_size = group_size
        self.capacity_factor_train = capacity_factor_train
        self.capacity_factor_eval = capacity_factor_eval
        self.dropout_rate = dropout_rate
        self.min_expert_capacity = min_expert_capacity
        self._activation = activation

    def call(self, context, x, losses=None):
        """``[batch..., length, d_model]`` (or ``[batch..., d_model]`` when decoding) -> same shape."""
        if context.model.ensemble_dim:
            raise NotImplementedError("MoE not yet implemented with ensembles")
        x_shape = x.shape
        has_length_dim = context.length_dim in x.shape.dims
        if not has_length_dim:
            x = mtf.reshape(x, mtf.Shape(list(x.shape.dims[:-1]) + [mtf.Dimension("length", 1)]
                                         + list(x.shape.dims[-1:])))
        if x.shape.ndims != 3:  # moe_apply wants [group, tokens, d_model]: fold extra batch dims into one group dim
            dims = list(x.shape.dims)
            x = mtf.reshape(x, mtf.Shape([mtf.Dimension(dims[0].name, mtf.Shape(dims[:-2]).size)] + dims[-2:]))
        d_model, tokens = x.shape.dims[-1], x.shape.dims[-2]
        experts = mtf.Dimension("experts", self.num_experts)
        experts_u = mtf.Dimension("experts_unsplit", self.num_experts)
        hidden = mtf.Dimension("expert_hidden", self.hidden_size)
        vd = context.variable_dtype
        with mtf.variable_scope("top_2_gating"):
            router = mtf.get_variable(x.mesh, "kernel", [d_model, experts_u], dtype=vd,
                                      initializer=mtf.VarianceScalingInitializer(1.0, "fan_in", "normal", [d_model],
                                                                                 [experts_u]))
        with mtf.variable_scope("wi"):
            wi = mtf.get_variable(x.mesh, "kernel", [experts, d_model, hidden], dtype=vd,
                                  initializer=mtf.VarianceScalingInitializer(1.0, "fan_in", "normal", [d_model],
                                                                             [hidden]))
        with mtf.variable_scope("wo"):
            wo = mtf.get_variable(x.mesh, "kernel", [experts, hidden, d_model], dtype=vd,
                                  initializer=mtf.VarianceScalingInitializer(1.0, "fan_in", "normal", [hidden],
                                                                             [d_model]))
        cf = self.capacity_factor_train if context.train else self.capacity_factor_eval
        capacity = expert_capacity(tokens.size, self.num_experts, cf, self.min_expert_capacity)
        y, loss = moe_apply(x, router, wi, wo, capacity, top_k=2, activation=self._activation)
        if context.losses is not None:
            context.losses.append(loss * self.loss_coef)
        return mtf.reshape(y, x_shape)
