"""Transformer feed-forward blocks: dense -> activation -> dense, and gated variants (GLU family).

:func:`feed_forward` is the one implementation: the CLI's LM (:func:`dense_act_dense`), Mesh TF's
``mtf.layers.dense_relu_dense`` and ``mtf.transformer``'s ``DenseReluDense`` call it, each with its own
variable names (``dense`` with graph-unique names, or Mesh TF's variable scopes through ``scoped_dense``).
"""

from __future__ import annotations

from meshtorch.core.dims import convert_to_dimension
from meshtorch.core.graph import Tensor
from meshtorch.layers.core import dense
from meshtorch.layers.dense_extra import dense_factors
from meshtorch.ops import elementwise as ew
from meshtorch.ops.random import dropout as mtf_dropout

_ACTIVATIONS = {"relu": ew.relu, "gelu": ew.gelu, "gelu_tanh": lambda x: ew.gelu(x, approximate="tanh"),
                "silu": lambda x: x * ew.sigmoid(x), "linear": lambda x: x}


def activation_function(name: str):
    """The feed-forward activation function named ``name``: ``relu``, ``gelu`` (erf), ``gelu_tanh`` (the tanh
    approximation), ``silu`` (``x * sigmoid(x)``, Swish) or ``linear``.

    Raises:
        ValueError: ``name`` is not one of these.
    """
    if name not in _ACTIVATIONS:
        raise ValueError(f"feed-forward activation {name!r} is not one of {sorted(_ACTIVATIONS)}.")
    return _ACTIVATIONS[name]


def dense_act_dense(x: Tensor, hidden_dim, activation: str = "relu", gated: bool = False, use_bias: bool = False,
                    name: str | None = None) -> Tensor:
    """``W_o act(W_i x)`` (Vaswani et al. 2017), or gated ``W_o (act(W_g x) * W_i x)`` (Shazeer 2020, GLU variants).

    Args:
        x: ``[..., d_model]`` (d_model = last dim).
        hidden_dim: the Dimension ``d_ff`` (may be split: then the output projection is one deferred
            all-reduce over its mesh axis).
        activation: relu, gelu, gelu_tanh, silu or linear. ``gated=True`` with gelu is GEGLU, with
            silu SwiGLU.

    Returns:
        Tensor of x's shape. Variables ``{name}/wi`` (``/wi_gate``) ``[d_model, d_ff]`` and ``{name}/wo``.
    """
    act = activation_function(activation)
    name = x.graph.unique_name(name or "ffn")
    factors = [(f"{name}/wi", None), (f"{name}/wi_gate", act)] if gated else [(f"{name}/wi", act)]
    return feed_forward(x, hidden_dim, factors, f"{name}/wo", use_bias=use_bias)


def feed_forward(x: Tensor, hidden_dim, factors, output_name: str, dense_fn=dense, use_bias: bool = False,
                 dropout_rate: float = 0.0, dropout_broadcast_dims=None, reduced_dims=None, **dense_kwargs) -> Tensor:
    """``W_o dropout(prod_i act_i(W_i x))``: the feed-forward layer of every transformer here.

    One factor is Vaswani et al. 2017's ``W_o act(W_i x)``; two are a GLU variant (Shazeer 2020; a product
    is exact in any order, so ``act(W_g x) * W_i x`` and ``W_i x * act(W_g x)`` are the same numbers).

    Args:
        x: ``[..., d_model]``.
        hidden_dim: the Dimension ``d_ff`` (may be split: the output projection is then one deferred
            all-reduce over its mesh axis).
        factors: ``[(variable name, activation)]`` of the input projections (activations: functions,
            mtf names, ``"linear"`` or None), multiplied in this order.
        output_name: the output projection's name.
        dense_fn: :func:`~meshtorch.layers.core.dense` (graph-unique names) or
            :func:`~meshtorch.layers.core.scoped_dense` (Mesh TF's variable scopes).
        dropout_rate / dropout_broadcast_dims: dropout of the hidden activations (the mask shared over
            the broadcast dims); pass 0 outside training.
        reduced_dims: x's dims the input projections contract (default its last).
        dense_kwargs: more keywords of ``dense_fn`` (``variable_dtype``, ``expert_dims``, ...).

    Returns:
        Tensor of x's shape with the last dim replaced by d_model (``x.shape[-1]``).
    """
    hidden_dim = convert_to_dimension(hidden_dim)
    d_model = x.shape[-1]
    h = dense_factors(dense_fn, x, reduced_dims, hidden_dim, factors, dict(use_bias=use_bias, **dense_kwargs))
    if dropout_rate:
        h = mtf_dropout(h, True, keep_prob=1.0 - dropout_rate,
                        noise_shape=h.shape - list(dropout_broadcast_dims or []))
    return dense_fn(h, d_model, reduced_dims=[hidden_dim], use_bias=use_bias, name=output_name, **dense_kwargs)


def dense_relu_dense(x: Tensor, hidden_channels, is_training, dropout=0.0, dropout_broadcast_dims=None,
                     master_dtype=None, slice_dtype=None, name=None) -> Tensor:
    """Mesh TF ``layers.dense_relu_dense``: ``wo(dropout(relu(wi(x))))`` without biases.

    Args:
        x: ``[..., io_channels]`` (last dim). hidden_channels: the hidden Dimension.
        is_training, dropout, dropout_broadcast_dims: dropout of the hidden activations (rate ``dropout``).
        master_dtype, slice_dtype: the variables' dtypes (default x's; Mesh TF's default float32).
        name: scope of the variables ``{name}/wi/kernel`` ``[io, hidden]`` and ``{name}/wo/kernel``.

    Returns:
        Tensor of x's shape. For GLU variants and other activations see :func:`dense_act_dense`.
    """
    scope = x.graph.unique_name(name or "dense_relu_dense")
    return feed_forward(x, hidden_channels, [(f"{scope}/wi", ew.relu)], f"{scope}/wo",
                        dropout_rate=dropout if is_training else 0.0, dropout_broadcast_dims=dropout_broadcast_dims,
                        master_dtype=master_dtype, slice_dtype=slice_dtype)
