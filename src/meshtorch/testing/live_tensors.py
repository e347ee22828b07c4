"""Bytes of the tensors alive in this process, counted op by op: an independent measurement of what a run holds
(issue 32), for comparing a planner's bytes with the tensor memory at the peak of a run on CPU, where torch keeps
no allocator statistics (``torch.cuda.max_memory_allocated``'s counterpart).

:class:`LiveTensorBytes` is a :class:`torch.utils._python_dispatch.TorchDispatchMode`: every ATen op's outputs
(``aten.empty`` of a receive buffer, a kernel's result, a ``clone``) register their storage under a weak
reference (:class:`torch.multiprocessing.reductions.StorageWeakRef`, PyTorch's own, as its multiprocessing and
``torch.utils.checkpoint`` use), storages that existed before (e.g. the weights) are registered with
:meth:`~LiveTensorBytes.track`, and after each op the bytes of the storages still alive are summed (views and
aliases count their storage once). ``peak`` is the largest such sum, in bytes; ``at_peak`` the storages
alive then (``{key: bytes}``; ``key`` as :meth:`LiveTensorBytes.key`). Not counted: memory outside tensors
(the interpreter, gloo's buffers, the allocator's free lists) and an op's internal scratch buffers.
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["LiveTensorBytes"]


class LiveTensorBytes(TorchDispatchMode):
    """``with LiveTensorBytes() as live: ...`` counts the bytes of live tensor storages after every op run
    inside; ``live.peak`` (bytes), ``live.at_peak`` (``{storage key: bytes}`` at the peak), ``live.bytes()``
    (bytes alive now). Single-threaded use; a few microseconds per op per live storage."""

    def __init__(self):
        super().__init__()
        self.refs: dict = {}  # key -> (StorageWeakRef, bytes)
        self.peak = 0
        self.at_peak: dict = {}

    @staticmethod
    def key(t: torch.Tensor) -> int:
        """The identity of ``t``'s storage (its ``StorageImpl`` address; equal for views of one storage)."""
        return t.untyped_storage()._cdata

    def track(self, tensors) -> None:
        """Count ``tensors`` (an iterable, or a pytree of them) that were made before the mode was entered."""
        for t in tree_leaves(tensors):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                s = t.untyped_storage()
                self.refs.setdefault(s._cdata, (StorageWeakRef(s), s.nbytes()))
        self._update()

    def bytes(self) -> int:
        """Bytes of the tracked storages alive now (expired ones are dropped)."""
        dead = [k for k, (ref, _) in self.refs.items() if ref.expired()]
        for k in dead:
            del self.refs[k]
        return sum(b for _, b in self.refs.values())

    def _update(self) -> None:
        now = self.bytes()
        if now > self.peak:
            self.peak = now
            self.at_peak = {k: b for k, (_, b) in self.refs.items()}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                s = t.untyped_storage()
                k = s._cdata
                old = self.refs.get(k)
                if old is None or old[0].expired():
                    self.refs[k] = (StorageWeakRef(s), s.nbytes())
        self._update()
        return out
