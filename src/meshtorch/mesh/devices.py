"""Mesh TF's ``mtf.parallel``: call a function once per device."""

from __future__ import annotations

import torch

__all__ = ["parallel"]


def parallel(devices, fn, *args, **kwargs) -> list:
    """``[fn(*args_i, **kwargs_i) for each device i]``, each call under ``torch.device(devices[i])`` as the
    default device (Mesh TF ``mtf.parallel``, which uses ``tf.device``).

    Every positional and keyword argument is a list with one entry per device.

    Raises:
        ValueError: if ``devices`` is not a list, or an argument is not a list as long as ``devices``.
    """
    if not isinstance(devices, list):
        raise ValueError("devices must be a list")
    for x in list(args) + list(kwargs.values()):
        if not isinstance(x, list) or len(x) != len(devices):
            raise ValueError(f"Argument not a list with same length as devices arg={x} devices={devices}")
    ret = []
    for i, device in enumerate(devices):
        with torch.device(device):
            ret.append(fn(*[x[i] for x in args], **{k: v[i] for k, v in kwargs.items()}))
    return ret
