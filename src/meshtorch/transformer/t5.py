"""T5 (Raffel et al. 2020) as Mesh TF built it: a :class:`Bitransformer` of pre-norm RMS layers with a shared
relative attention bias per stack, the architecture of Hugging Face's ``T5ForConditionalGeneration``.

:func:`t5_bitransformer` gives the model of T5 v1.1 (``feed_forward_proj="gated-gelu"``: GEGLU with the tanh
GELU, untied output layer) or of the original T5 (``"relu"``); the weights come from a Hugging Face directory
through :mod:`meshtorch.checkpoint.hf`. Variable names are Mesh TF's (``shared/embedding``,
``encoder/block_000/layer_000/SelfAttention/q``, ..., ``decoder/logits/kernel``).
"""

from __future__ import annotations

import functools

from meshtorch.ops.elementwise import gelu
from meshtorch.transformer._bitransformer import Bitransformer
from meshtorch.transformer._layer_stack import make_layer_stack
from meshtorch.transformer._unitransformer import Unitransformer
from meshtorch.transformer.transformer_layers import DenseReluDense, EncDecAttention, SelfAttention

__all__ = ["t5_bitransformer"]


def t5_bitransformer(vocab_size: int, d_model: int, num_heads: int, d_kv: int, d_ff: int, num_layers: int,
                     num_decoder_layers: int | None = None, relative_attention_num_buckets: int = 32,
                     gated_gelu: bool = True) -> Bitransformer:
    """The T5 encoder-decoder (Mesh TF ``Bitransformer`` of ``Unitransformer`` stacks).

    Encoder blocks: self-attention with a ``bias_shared`` relative attention bias ``[heads, buckets]``
    (bidirectional buckets), feed-forward. Decoder blocks: causal self-attention with its own shared bias
    (unidirectional buckets), encoder-decoder attention, feed-forward. Attention logits are not scaled
    (T5 folds ``1/sqrt(d_kv)`` into the query's initialisation); norms are RMS norms (eps 1e-6); no
    positional embedding, no dropout, no z-loss; the vocabulary is not padded (``vocab_divisor=1``).

    Args:
        gated_gelu: T5 v1.1's ``wo(gelu_tanh(wi_0 x) * wi_1 x)`` (variables ``wi_0``, ``wi_1``); False: the
            original T5's ``wo(relu(wi x))``.

    Returns:
        a :class:`Bitransformer` whose ``call_simple(inputs, targets, ...)`` gives the decoder's logits
        ``[batch, length, vocab]`` for targets shifted right with 0 as the start token.
    """
    act = [functools.partial(gelu, approximate="tanh"), "linear"] if gated_gelu else "relu"
    sa = [SelfAttention, {"num_heads": num_heads, "key_value_size": d_kv, "relative_attention_type": "bias_shared",
                          "relative_attention_num_buckets": relative_attention_num_buckets}]
    ed = [EncDecAttention, {"num_heads": num_heads, "key_value_size": d_kv}]
    ff = [DenseReluDense, {"hidden_size": d_ff, "activation": act}]
    common = {"d_model": d_model, "input_vocab_size": vocab_size, "positional_embedding": False, "z_loss": 0.0,
              "vocab_divisor": 1}
    encoder = Unitransformer(layer_stack=make_layer_stack([sa, ff], num_layers=num_layers), output_vocab_size=None,
                             autoregressive=False, name="encoder", **common)
    decoder = Unitransformer(layer_stack=make_layer_stack([sa, ed, ff], num_layers=num_decoder_layers or num_layers),
                             output_vocab_size=vocab_size, autoregressive=True, name="decoder", **common)
    return Bitransformer(encoder, decoder, shared_embedding=True)
