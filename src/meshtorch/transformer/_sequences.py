"""Sequence helpers of Mesh TF's ``transformer.py``: ``autoregressive_inputs`` and the delimited-LM mask."""

from __future__ import annotations

from meshtorch.transformer import _mtf as mtf


def _round_up_to_multiple(n, divisor):
    return n + -n % divisor


def delimited_lm_inputs_mask(ids, eos_id=1):
    """Bool mask of the "inputs" parts of ``[<inputs>, EOS, <targets>, EOS, ...]`` sequences (Mesh TF).

    The inputs are where the number of earlier EOS tokens is even.
    """
    length_dim = ids.shape.dims[-1]
    eos_before = mtf.cumsum(mtf.to_int32(mtf.equal(ids, eos_id)), length_dim, exclusive=True)
    return mtf.equal(mtf.mod(eos_before, 2), 0)


def autoregressive_inputs(targets, sequence_id=None):
    """Decoder inputs: targets shifted right by one along length, 0 first (Mesh TF ``autoregressive_inputs``).

    Args:
        targets: integer ``[..., length]`` (negative ids mark masked loss; their absolute value is used).
        sequence_id: optional ``[..., length]`` ids of packed sequences: the first position of each
            sequence also gets 0.

    Returns:
        integer Tensor of ``targets``' shape and dtype.
    """
    length_dim = targets.shape.dims[-1]
    inputs = mtf.shift(targets, offset=1, dim=length_dim, wrap=False)
    inputs = mtf.abs(inputs)
    if sequence_id is not None:
        not_first = mtf.equal(sequence_id, mtf.shift(sequence_id, offset=1, dim=length_dim, wrap=False))
        inputs *= mtf.cast(not_first, inputs.dtype)
    return inputs
