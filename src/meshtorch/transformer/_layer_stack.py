"""``LayerStack``, its sublayer functions and ``make_layer_stack`` (Mesh TF ``transformer/transformer.py``).

A sublayer is a function ``(x, layer_stack, context) -> y``. Without gin, the defaults are those of
Mesh TF's ``defaults.gin``:

* initial: ``[sublayer_dropout]``
* per layer: ``[sublayer_rms_norm, sublayer_call_layer, sublayer_dropout, sublayer_residual]``
* final: ``[sublayer_rms_norm, sublayer_dropout]``

``sublayer_dropout``'s rate defaults to 0.0 as in Mesh TF's code (``defaults.gin`` sets 0.1); pass
``functools.partial(sublayer_dropout, dropout_rate=0.1)`` where a gin file would bind it.
"""

from __future__ import annotations

from meshtorch.transformer import _mtf as mtf
from meshtorch.transformer._context import TransformerLayer


def sublayer_mask_padding(x, layer_stack, context):
    """Zero the padding positions (``sequence_id == 0``) when a sequence-id Tensor is given (Mesh TF)."""
    del layer_stack
    if isinstance(context.sequence_id, mtf.Tensor):
        return x * mtf.cast(mtf.not_equal(context.sequence_id, 0), context.activation_dtype)
    return x


def sublayer_call_layer(x, layer_stack, context):
    """Call ``context.current_layer`` inside ``variable_scope(<its class name>)``."""
    x = sublayer_mask_padding(x, layer_stack, context)
    layer = context.current_layer
    with mtf.variable_scope(layer.__class__.__name__):
        return layer.call(context, x)


def sublayer_rms_norm(x, layer_stack, context, epsilon=1e-6, name="rms_norm"):
    """``x * rsqrt(mean_{d_model}(x^2) + epsilon) * scale``; variable ``{name}/scale`` ``[d_model]`` (ones)."""
    del layer_stack
    model_dim = context.model.model_dim
    with mtf.variable_scope(name):
        scale = mtf.get_variable(context.mesh, "scale", mtf.Shape(context.model.ensemble_dims + [model_dim]),
                                 initializer=mtf.ones_initializer(), dtype=context.variable_dtype)
        variance = mtf.reduce_mean(mtf.square(x), reduced_dim=model_dim)
    return x * mtf.rsqrt(variance + epsilon) * scale


def sublayer_legacy_rms_norm(x, layer_stack, context):
    """Deprecated in Mesh TF: rms_norm named ``layer_norm`` (old checkpoints)."""
    return sublayer_rms_norm(x, layer_stack, context, name="layer_norm")


def sublayer_legacy_final_rms_norm(x, layer_stack, context):
    """Deprecated in Mesh TF: rms_norm named ``final_layer_norm`` (old checkpoints)."""
    return sublayer_rms_norm(x, layer_stack, context, name="final_layer_norm")


def sublayer_true_layer_norm(x, layer_stack, context, epsilon=1e-6):
    """Layer normalisation over d_model (Mesh TF ``sublayer_true_layer_norm``).

    Variables ``true_layer_norm/layer_prepostprocess/layer_norm/layer_norm_scale`` and
    ``.../layer_norm_bias`` ``[d_model]``, as Mesh TF's ``mtf.layers.layer_norm`` names them.
    """
    del layer_stack
    model_dim = context.model.model_dim
    with mtf.variable_scope("true_layer_norm"):
        return _mtf_layer_norm(x, model_dim, epsilon)


def _mtf_layer_norm(x, dim, epsilon=1e-6, name="layer_prepostprocess"):
    """Mesh TF ``mtf.layers.layer_norm``: ``(x - mean) * rsqrt(var + eps) * scale + bias`` with its variable names."""
    with mtf.variable_scope(name + "/layer_norm"):
        scale = mtf.get_variable(x.mesh, "layer_norm_scale", mtf.Shape([dim]), initializer=mtf.ones_initializer(),
                                 dtype=x.dtype)
        bias = mtf.get_variable(x.mesh, "layer_norm_bias", mtf.Shape([dim]), initializer=mtf.zeros_initializer(),
                                dtype=x.dtype)
        reduced_shape = x.shape - dim
        mean = mtf.reduce_mean(x, output_shape=reduced_shape)
        variance = mtf.reduce_mean(mtf.square(x - mean), output_shape=reduced_shape)
        norm_x = (x - mean) * mtf.rsqrt(variance + epsilon)
        return norm_x * scale + bias


sublayer_layer_norm = sublayer_true_layer_norm


def sublayer_residual(x, layer_stack, context):
    """``x + context.current_layer_input``."""
    del layer_stack
    return x + context.current_layer_input


def sublayer_dropout(x, layer_stack, context, dropout_rate=0.0):
    """Dropout in ``"train"`` mode, noise shared along the length dim (``noise_shape = batch + [d_model]``)."""
    del layer_stack
    if context.train and dropout_rate > 0:
        return mtf.dropout(x, context.train, rate=dropout_rate,
                           noise_shape=mtf.Shape(context.batch_dims + [context.model.model_dim]))
    return x


def sublayer_legacy_dropout(x, layer_stack, context):
    return sublayer_dropout(x, layer_stack, context, dropout_rate=layer_stack.dropout_rate)


def sublayer_rezero(x, layer_stack, context, initial_value=0.0):
    """Multiply by a scalar variable ``rezero_weight`` (initially ``initial_value``; residual not included)."""
    del layer_stack
    w = mtf.get_variable(x.mesh, "rezero_weight", shape=context.model.ensemble_dims, dtype=context.variable_dtype,
                         initializer=float(initial_value))
    return x * w


DEFAULT_SUBLAYERS_INITIAL = (sublayer_dropout,)
DEFAULT_SUBLAYERS_PER_LAYER = (sublayer_rms_norm, sublayer_call_layer, sublayer_dropout, sublayer_residual)
DEFAULT_SUBLAYERS_FINAL = (sublayer_rms_norm, sublayer_dropout)


class LayerStack(TransformerLayer):
    """A stack of layers with residual connections and norms (Mesh TF ``transformer.LayerStack``).

    Args:
        layers: list of TransformerLayer (each named, e.g. by :func:`make_layer_stack`).
        sublayers_initial / sublayers_per_layer / sublayers_final: lists of sublayer functions;
            None means Mesh TF's ``defaults.gin`` lists (module docstring).
        dropout_rate / norm_epsilon: Mesh TF's deprecated legacy mode (both or neither).
        recompute_grads: recompute each layer's activations in the backward pass (``mtf.recompute_grad``).

    Variables: each layer's under ``<layer name>/`` (e.g. ``block_000/layer_000/rms_norm/scale``,
    ``block_000/layer_000/SelfAttention/q``) and the final norm's ``rms_norm/scale``, all inside the
    model's scope (``transformer/``, ``encoder/``, ``decoder/``).

    Raises:
        ValueError: if exactly one of ``dropout_rate`` and ``norm_epsilon`` is given.
    """

    def __init__(self, layers, sublayers_initial=None, sublayers_per_layer=None, sublayers_final=None,
                 dropout_rate=None, norm_epsilon=None, recompute_grads=False):
        self._layers = layers
        self._recompute_grads = recompute_grads
        self._sublayers_initial = list(DEFAULT_SUBLAYERS_INITIAL if sublayers_initial is None else sublayers_initial)
        self._sublayers_per_layer = list(DEFAULT_SUBLAYERS_PER_LAYER if sublayers_per_layer is None
                                         else sublayers_per_layer)
        self._sublayers_final = list(DEFAULT_SUBLAYERS_FINAL if sublayers_final is None else sublayers_final)
        if (dropout_rate is not None) != (norm_epsilon is not None):
            raise ValueError("LayerStack.dropout_rate and LayerStack.norm_epsilon should either be both not None "
                             "(legacy mode) or both None (normal mode)")
        if dropout_rate is not None:
            self.dropout_rate = dropout_rate
            self.norm_epsilon = norm_epsilon
            self._sublayers_initial = [sublayer_legacy_dropout]
            self._sublayers_per_layer = [sublayer_legacy_rms_norm, sublayer_call_layer, sublayer_legacy_dropout,
                                         sublayer_residual]
            self._sublayers_final = [sublayer_legacy_final_rms_norm, sublayer_legacy_dropout]

    def call(self, context, x):
        """Call the layer stack: ``x`` ``[batch..., length, d_model]`` -> same shape."""
        x = self._call_sublayers(self._sublayers_initial, x, context)
        context.layer_outputs.append(x)
        for lnum, layer in enumerate(self._layers):
            with mtf.variable_scope(layer.name or ""):
                if self._recompute_grads:
                    def fn(x, layer=layer, c=context):
                        return self._layer_fn(x, layer, c)
                    x = mtf.recompute_grad(fn, [x])
                else:
                    x = self._layer_fn(x, layer, context)
            if lnum != len(self._layers) - 1:
                context.layer_outputs.append(x)
            context.layer_index += 1
        x = self._call_sublayers(self._sublayers_final, x, context)
        x = sublayer_mask_padding(x, self, context)
        context.layer_outputs.append(x)
        return x

    def _call_sublayers(self, sublayers, x, context):
        for s in sublayers:
            x = s(x, self, context)
        return x

    def _layer_fn(self, x, layer, context):
        context.current_layer = layer
        context.current_layer_input = x
        y = self._call_sublayers(self._sublayers_per_layer, x, context)
        if y.shape != x.shape:
            raise ValueError(f"Layer {layer.__class__.__name__} returned misshaped output x={x} y={y}")
        return y

    @property
    def num_layers(self):
        return len(self.layers)

    @property
    def layers(self):
        return self._layers


def make_layer_stack(layers, layer_stack_cls=LayerStack, num_layers=6, block_scope=True):
    """Build ``num_layers`` blocks of ``layers`` (Mesh TF ``transformer.make_layer_stack``, gin-free).

    Args:
        layers: list of specifications, each a TransformerLayer subclass or a list/tuple holding the
            class, optionally a name (str) and constructor kwargs (dict), e.g.
            ``[SelfAttention, [DenseReluDense, "feedforward", {"hidden_size": 2048}]]``.
        layer_stack_cls: LayerStack or a subclass.
        num_layers: number of blocks.
        block_scope: names ``block_{b:03d}/layer_{n:03d}`` (True) or ``layer_{i:03d}`` (False).

    Returns:
        a ``layer_stack_cls`` instance.
    """
    stack = []
    for block in range(num_layers):
        for n, cls in enumerate(layers):
            name, kwargs = None, {}
            if isinstance(cls, list | tuple):
                for x in cls:
                    if isinstance(x, str):
                        name = x
                    elif isinstance(x, dict):
                        kwargs = x
                    else:
                        cls = x
            if block_scope:
                name = "block_{:03d}/{}".format(block, name or f"layer_{n:03d}")
            else:
                name = name or f"layer_{len(stack):03d}"
            layer = cls(**kwargs)
            layer.set_name(name)
            stack.append(layer)
    return layer_stack_cls(stack)
