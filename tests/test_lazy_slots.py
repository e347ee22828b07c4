"""Zero-initialised state (AdamW moments, other zero slots) costs no memory until first written (issue 33's build
time): its pages are not resident after the build and are after the first step, and the training values are
bitwise those of eagerly zeroed state. Residency is read from ``/proc/self/pagemap`` (bit 63: page present), so
the checks do not depend on the allocator or on other processes."""

from __future__ import annotations

import gc
import os
import struct
import sys

import pytest
import torch

from meshtorch.lowering import Lowering, variables
from meshtorch.mesh.factory import make_mesh_impl
from meshtorch.models.transformer import build_lm, preset
from meshtorch.ops import initializers
from meshtorch.ops.initializers import populate, untouched_zeros
from meshtorch.optim import AdamWOptimizer

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/pagemap (Linux)")
PAGE = os.sysconf("SC_PAGE_SIZE")


def resident_pages(t: torch.Tensor) -> tuple[int, int]:
    """(pages of ``t``'s bytes present in memory, pages it spans), from ``/proc/self/pagemap``."""
    first, last = t.data_ptr() // PAGE, (t.data_ptr() + t.numel() * t.element_size() - 1) // PAGE
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        entries = struct.unpack(f"{last - first + 1}Q", f.read((last - first + 1) * 8))
    return sum(e >> 63 for e in entries), len(entries)


def mapped(address: int) -> bool:
    """Whether ``address`` lies in a mapping of this process (``/proc/self/maps``)."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return True
    return False


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_untouched_zeros_are_writable_aligned_lazy_and_freed(dtype):
    t = untouched_zeros((300, 2048), dtype)
    assert t.shape == (300, 2048) and t.dtype == dtype and t.is_contiguous() and t.device.type == "cpu"
    assert t.data_ptr() % PAGE == 0  # (torch's own allocator aligns to 64 bytes)
    assert resident_pages(t)[0] == 0
    t[7].fill_(3.0)
    present, pages = resident_pages(t)
    assert 0 < present < pages  # the written pages only
    assert torch.count_nonzero(t) == 2048  # zeros elsewhere (this read maps the others to the shared zero page)
    t.add_(1.0)
    assert resident_pages(t)[0] == pages and t[7, 0] == 4.0 and t[8, 0] == 1.0
    address = t.data_ptr()
    del t
    gc.collect()
    assert not mapped(address)
    small = untouched_zeros((4, 4), dtype)  # below ZERO_PAGES_MIN_BYTES: a torch allocation
    assert torch.count_nonzero(small) == 0 and small.add_(1).sum() == 16
    assert not populate(small)


def test_populate_makes_untouched_zeros_resident_in_one_call():
    t = untouched_zeros((512, 1024), torch.float32)
    assert populate(t)
    present, pages = resident_pages(t)
    assert present == pages
    assert torch.count_nonzero(t) == 0


def _train(steps: int):
    cfg = preset("tiny", num_layers=1, d_model=256, num_heads=4, d_kv=64, d_ff=1024, vocab_size=256, length=16,
                 batch_size=2)
    lm = build_lm(cfg, seed=3, optimizer=AdamWOptimizer(1e-3, weight_decay=0.01))
    lw = Lowering(lm.graph, {lm.mesh: make_mesh_impl("", "")})
    slots = {f"{n}:{i}": t for n in lw.store.names if "/adam_" in n
             for i, t in enumerate(lw.store.impl(n).local_slices(lw.store.values[n]))}
    big = {n: t for n, t in slots.items() if t.numel() * t.element_size() >= initializers.ZERO_PAGES_MIN_BYTES}
    built = {n: (resident_pages(t), t) for n, t in big.items()}
    untouched = set(lw.store.untouched)
    ids = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    losses = [float(lw.run([lm.loss] + lm.updates, {lm.inputs: ids[:, :-1], lm.targets: ids[:, 1:]})[0])
              for _ in range(steps)]
    stepped = {n: resident_pages(t) for n, t in big.items()}
    return built, stepped, losses, {n: lw.store.value(n) for n in lw.store.names}, untouched


def test_optimizer_slots_are_resident_only_after_the_first_step_with_the_same_values(monkeypatch):
    populated = []  # the first run populates each untouched slot (one call, not a fault per page read then written)
    monkeypatch.setattr(variables, "populate", lambda t: populated.append(t.data_ptr()) or populate(t))
    built, stepped, losses, values, untouched = _train(2)
    assert {t.data_ptr() for _, t in built.values()} <= set(populated)
    assert len(built) >= 4  # the MLP's two [d_model, d_ff] kernels' m and v: 1 MiB each
    assert {n.split(":")[0] for n in built} <= untouched
    assert all(present == 0 for (present, _), _ in built.values()), built
    assert all(present == pages for present, pages in stepped.values()), stepped
    monkeypatch.setattr(initializers, "ZERO_PAGES_MIN_BYTES", 2 ** 62)  # eagerly zeroed state, as before
    eager_built, _, eager_losses, eager_values, _ = _train(2)
    assert all(present == pages for (present, pages), _ in eager_built.values())
    assert losses == eager_losses
    assert all(torch.equal(values[n], eager_values[n]) for n in values)
