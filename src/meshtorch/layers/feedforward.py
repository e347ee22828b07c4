"""Transformer feed-forward blocks: dense -> activation -> dense, and gated variants (GLU family)."""

from __future__ import annotations

from meshtorch.core.dims import convert_to_dimension
from meshtorch.core.graph import Tensor
from meshtorch.layers.core import dense
from meshtorch.ops import elementwise as ew
from meshtorch.ops.random import dropout as mtf_dropout

_ACTIVATIONS = {"relu": ew.relu, "gelu": ew.gelu, "gelu_tanh": lambda x: ew.gelu(x, approximate="tanh"),
                "silu": lambda x: x * ew.sigmoid(x), "linear": lambda x: x}


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
    if activation not in _ACTIVATIONS:
        raise ValueError(f"dense_act_dense: activation {activation!r} is not one of {sorted(_ACTIVATIONS)}.")
    hidden_dim = convert_to_dimension(hidden_dim)
    d_model = x.shape[-1]
    name = x.graph.unique_name(name or "ffn")
    act = _ACTIVATIONS[activation]
    h = dense(x, hidden_dim, use_bias=use_bias, name=f"{name}/wi")
    if gated:
        h = act(dense(x, hidden_dim, use_bias=use_bias, name=f"{name}/wi_gate")) * h
    else:
        h = act(h)
    return dense(h, d_model, reduced_dims=[hidden_dim], use_bias=use_bias, name=f"{name}/wo")


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
    io_channels = x.shape.dims[-1]
    hidden_channels = convert_to_dimension(hidden_channels)
    scope = x.graph.unique_name(name or "dense_relu_dense")
    h = dense(x, hidden_channels, use_bias=False, activation=ew.relu, master_dtype=master_dtype,
              slice_dtype=slice_dtype, name=f"{scope}/wi")
    if is_training and dropout:
        h = mtf_dropout(h, is_training, rate=dropout,
                        noise_shape=h.shape - [d.name for d in (dropout_broadcast_dims or [])])
    return dense(h, io_channels, reduced_dims=[hidden_channels], use_bias=False, master_dtype=master_dtype,
                 slice_dtype=slice_dtype, name=f"{scope}/wo")
