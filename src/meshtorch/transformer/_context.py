"""``TransformerLayer`` and ``Context`` (Mesh TF ``transformer/transformer.py``).

A layer's constructor records hyper-parameters; its ``call(context, x)`` creates the variables
(under the enclosing ``mtf.variable_scope``) and returns a Tensor of ``x``'s shape. The Context
carries what a call needs: the model, mesh, batch and length dims, the VariableDType, the mode,
positions, sequence ids, the losses list, and the decoding states.

Modes are Mesh TF's strings: ``"train"``, ``"eval"``, ``"infer"`` (``tf.estimator.ModeKeys``'s
values), plus ``"first_part"`` and ``"incremental"`` used inside autoregressive decoding.
"""

from __future__ import annotations

import json

import torch

from meshtorch.transformer import _mtf as mtf

TRAIN, EVAL, PREDICT = "train", "eval", "infer"
MODES = (TRAIN, EVAL, PREDICT, "first_part", "incremental")


def check_mode(mode) -> str:
    """``mode`` if it is one of :data:`MODES`, else a ValueError naming the accepted strings."""
    if mode not in MODES:
        raise ValueError(f"transformer: mode must be one of {MODES} (Mesh TF's tf.estimator.ModeKeys values and "
                         f"the decoding modes), got {mode!r}.")
    return mode


class TransformerLayer:
    """Base class of transformer layers (Mesh TF ``transformer.TransformerLayer``).

    Subclasses record hyper-parameters in ``__init__`` and implement ``call(context, x)``, which
    creates variables (inside the scope the LayerStack opens) and returns a Tensor of x's shape.
    """

    def call(self, context, x):
        """Call the layer: ``x`` ``[batch..., length, d_model]`` -> Tensor of the same shape."""
        raise NotImplementedError("Not implemented")

    def to_json(self):
        return json.dumps(self, cls=json.JSONEncoder)

    def set_name(self, name):
        self._name = name

    @property
    def name(self):
        return getattr(self, "_name", None)


class Context:
    """Extra information layers need at call time (Mesh TF ``transformer.Context``; same arguments).

    See Mesh TF's docstring for each field. ``mode`` is a string (see :data:`MODES`);
    ``variable_dtype`` a ``mtf.VariableDType``.
    """

    def __init__(self, model, mesh, batch_dims, length_dim, variable_dtype, beam_dim=None, mode=TRAIN,
                 position=None, position_is_default=False, sequence_id=None, subsequence_id=None, states=None,
                 new_states=None, losses=None, initial_position=None, layer_outputs=None, encoder_output=None,
                 encoder_sequence_id=None, constant_states=None, shared_params=None, encoder_layer_outputs=None,
                 write_priority=None, read_priority=None, inputs=None, encoder_inputs=None, num_microbatches=1):
        self.model = model
        self.mesh = mesh
        self.batch_dims = batch_dims
        self.length_dim = length_dim
        self.variable_dtype = variable_dtype
        self.beam_dim = beam_dim
        self.mode = check_mode(mode)
        self.position = position
        self.position_is_default = position_is_default
        self.sequence_id = sequence_id
        self.subsequence_id = subsequence_id
        self.states = states
        self.new_states = new_states
        self.losses = losses
        self.initial_position = initial_position
        self.layer_outputs = layer_outputs if layer_outputs is not None else []
        self.encoder_output = encoder_output
        self.encoder_sequence_id = encoder_sequence_id
        self.constant_states = constant_states
        self.next_constant_state = 0
        self.shared_params = shared_params or {}
        self.layer_index = 0
        self.encoder_layer_outputs = encoder_layer_outputs
        self.cache = {}
        self.write_priority = write_priority
        self.read_priority = read_priority
        self.inputs = inputs
        self.encoder_inputs = encoder_inputs
        self.num_microbatches = num_microbatches
        self.input_embeddings = None

    @property
    def train(self) -> bool:
        return self.mode == TRAIN

    @property
    def activation_dtype(self):
        return self.variable_dtype.activation_dtype

    @property
    def encoder_length_dim(self):
        ret, = [d for d in self.encoder_output.shape.dims if d.name == "memory_length"]
        return ret

    def get_states(self, n):
        """The next ``n`` recurrent states (``"incremental"`` mode)."""
        return self.states[len(self.new_states):len(self.new_states) + n]

    def record_new_states(self, new_states):
        """Record new values of recurrent states (``"first_part"`` / ``"incremental"`` modes)."""
        self.new_states.extend(new_states)

    def record_constant_state(self, s):
        """Record state computed once in ``"first_part"`` mode, read in ``"incremental"`` mode."""
        self.constant_states.append(s)

    def get_constant_state(self):
        ret = self.constant_states[self.next_constant_state]
        self.next_constant_state += 1
        return ret

    @property
    def nonpadding(self):
        """Zeros at padding positions, ones elsewhere (None without a sequence id)."""
        if self.sequence_id is None:
            return None
        if isinstance(self.sequence_id, int) and self.sequence_id == 1:
            return 1
        return mtf.cast(mtf.not_equal(self.sequence_id, 0), self.activation_dtype)

    def get_position(self):
        if self.position_is_default:
            return mtf.range(self.mesh, self.length_dim, torch.int32)
        return self.position
