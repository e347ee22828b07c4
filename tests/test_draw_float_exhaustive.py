"""The draw's NumPy float part (issue 33: fewer, cheaper passes) against the generator's torch formulas on every
possible input: the top 24 random bits take only 2**24 values, so each is checked once, bit for bit.

The reference is the Box-Muller / uniform formula written out of place with torch ops (as
``tests/test_draw_numpy_reference.py`` writes it), not the library's in-place code.
"""

import math

import numpy as np
import torch

from meshtorch.ops import rng

S24 = 2.0 ** -24


def test_normal_float_part_equals_torch_formula_on_every_24_bit_input():
    t0 = np.arange(2 ** 24, dtype=np.float32)  # every radius input once ...
    t1 = t0[::-1].copy()  # ... and every angle input once, paired differently
    ref = torch.sqrt(torch.log((torch.from_numpy(t0) + 1.0) * S24) * -2.0) * torch.cos(
        torch.from_numpy(t1) * (S24 * 2.0 * math.pi))
    rng._normal24_np(t0, t1)
    assert torch.equal(torch.from_numpy(t0), ref)


def test_uniform_float_part_equals_torch_formula_on_every_24_bit_input():
    t = np.arange(2 ** 24, dtype=np.float32)
    ref = torch.from_numpy(t) * S24
    rng._uniform24_np(t)
    assert torch.equal(torch.from_numpy(t), ref)
