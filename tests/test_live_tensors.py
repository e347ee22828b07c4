"""meshtorch.testing.live_tensors.LiveTensorBytes (the independent count the pipeline memory test trusts) against
byte counts worked out by hand: float32 tensors of known sizes, views sharing a storage, tensors freed."""

from __future__ import annotations

import torch

from meshtorch.testing.live_tensors import LiveTensorBytes


def test_counts_each_live_storage_once_and_drops_freed_ones():
    w = torch.zeros(10)  # made before: 40 bytes, counted through track
    with LiveTensorBytes() as live:
        live.track([w, w.view(2, 5)])
        a = torch.ones(100)  # 400 bytes
        v = a.view(10, 10).t()  # views: no new storage
        b = v * 2  # 400 bytes: the peak, 40 + 400 + 400
        del a, v, b
        c = torch.ones(50)  # 200 bytes
    assert live.peak == 40 + 400 + 400
    assert live.bytes() == 40 + 200
    assert sorted(live.at_peak.values()) == [40, 400, 400]
    del c
    assert live.bytes() == 40
