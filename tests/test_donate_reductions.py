"""An all-reduce whose input no other step reads sums in that buffer instead of a copy
(``meshtorch.lowering.donate.donate_reductions``): on 2 gloo ranks the weight gradients' all-reduces own
their buffers and the values equal plain PyTorch's; the pass declines inputs another step reads, variables,
kept values, outputs of kernels not known to return new tensors, and placement meshes."""

from __future__ import annotations

import os
import types

import pytest
import torch

import meshtorch as mtf
from meshtorch.lowering.donate import donate_reductions, donated_outputs
from meshtorch.lowering.program import Step
from meshtorch.testing.spmd import run_spmd

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def _reference(x, y, steps=3, lr=0.1):
    """The same MLP and SGD steps in plain PyTorch on full tensors, from the job's initial weights."""
    import sys
    sys.path.insert(0, TESTS_DIR)
    from _donate_jobs import _mlp

    g, mesh, *_ = _mlp(x, y)
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("", "")})
    w1, w2 = (lw.variable_value(n).clone().requires_grad_() for n in ("w1", "w2"))
    losses, grads = [], []
    for _ in range(steps):
        loss = ((torch.relu(x @ w1) @ w2 - y) ** 2).mean()
        g1, g2 = torch.autograd.grad(loss, [w1, w2])
        losses.append(loss.item())
        grads.append(g2)
        with torch.no_grad():
            w1 -= lr * g1
            w2 -= lr * g2
    return losses, grads, {"w1": w1.detach(), "w2": w2.detach()}


@pytest.mark.parametrize("fetch_grad", [False, True])
def test_gradient_allreduces_sum_in_their_own_buffers_with_plain_pytorch_values(fetch_grad):
    results = run_spmd("_donate_jobs:donated_allreduce_job", args=(fetch_grad,), nprocs=2, timeout_s=300,
                       extra_path=[TESTS_DIR]).check().results
    ref_losses, ref_grads, ref_weights = _reference(results[0]["x"], results[0]["y"])
    for res in results:
        torch.testing.assert_close(res["losses"], ref_losses, rtol=1e-5, atol=0)
        for n, w in ref_weights.items():
            torch.testing.assert_close(res["weights"][n], w, rtol=1e-5, atol=1e-6)
        by_shape = {}
        for shape, owned, same in res["calls"]:
            by_shape.setdefault(shape, set()).add((owned, same))
        # the weight gradients (matmul outputs read only by their all-reduce) are summed in their own buffers,
        # also when the sum is fetched (a result of the run: the output, not the input, is kept)
        assert by_shape[(8, 8)] == {(True, True)} and by_shape[(8, 4)] == {(True, True)}
        assert by_shape[()] == {(False, False)}  # the loss: a reduce_sum's output (not known fresh): copied
        for (got, twice), want in zip(res["grads"], ref_grads if fetch_grad else [], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(twice, 2 * want, rtol=1e-5, atol=1e-6)


class _OneProcessor:
    def local_pnums(self):
        return [0]


def _fresh_kernel(x):
    return x * 1


_fresh_kernel.fresh_outputs = True


def _view_kernel(x):
    return x.view(-1)


@pytest.mark.parametrize("case", ["donated", "second_reader", "variable", "kept", "not_fresh", "two_outputs",
                                  "placement"])
def test_donation_needs_a_fresh_unshared_input_read_by_the_all_reduce_alone(case):
    """The pass on hand-made programs: slot 1 (produced by step 0 from slot 0) all-reduced into slot 2."""
    produce = Step("slicewise", "grad", (0,), (1, 5) if case == "two_outputs" else (1,), "m",
                   _view_kernel if case == "not_fresh" else _fresh_kernel, {})
    reduce = Step("allreduce", "grad", (1,), (2,), "m", None, {"mesh_axes": (0,), "reduction": "SUM"})
    steps = [produce, reduce]
    if case == "second_reader":
        steps.append(Step("slicewise", "other", (1,), (3,), "m", _fresh_kernel, {}))
    impls = {"m": mtf.PlacementMeshImpl("all:2", "") if case == "placement" else _OneProcessor()}
    out = donate_reductions(steps, {1} if case == "variable" else set(), {1, 2} if case == "kept" else {2}, impls)
    assert out[1].params.get("donate", False) == (case == "donated")
    assert donated_outputs(out[1]) == (case == "donated")
    assert out[0] is steps[0] and steps[1].params == {"mesh_axes": (0,), "reduction": "SUM"}  # inputs unchanged


class _OneProcessorOfAxis(_OneProcessor):
    """This process holds one processor of a 1-axis mesh of ``n`` (what the donation pass reads)."""

    def __init__(self, n):
        self.shape = [types.SimpleNamespace(size=n)]


@pytest.mark.parametrize("n", [2, 1])
def test_an_all_gathered_input_is_fresh_when_its_group_has_members(n):
    """The all-gather record's ``fresh_output``: over a group of 2 the gathered value is a new tensor, so the
    all-reduce of it may sum in its buffer; over a group of one the all-gather returns its input (shared
    storage), so it may not."""
    gather = Step("allgather", "g", (0,), (1,), "m", None, {"mesh_axis": 0, "concat_axis": 0})
    reduce = Step("allreduce", "r", (1,), (2,), "m", None, {"mesh_axes": (0,), "reduction": "SUM"})
    out = donate_reductions([gather, reduce], set(), {2}, {"m": _OneProcessorOfAxis(n)})
    assert out[1].params.get("donate", False) == (n > 1)
