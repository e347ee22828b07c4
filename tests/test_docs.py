"""The Python code blocks of README.md and docs/*.md run as written (issue 25).

Each ```python block of a page runs, in order, in one namespace per page (so a page's blocks may build
on each other), in this test process (one import of torch for all pages) with a temporary working
directory (files they write stay out of the checkout; torch's thread count and RNG are restored).
A block preceded by an HTML comment
``<!-- no-test: reason -->`` is opted out (the reason says why: it needs torchrun, minutes, or a
download). The test counts the blocks run and opted out, and fails naming the page, the block's line and
the error when a block does not run.
"""

from __future__ import annotations

import os
import re

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs"))
                               if f.endswith(".md"))
_FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)
_OPT_OUT = re.compile(r"<!--\s*no-test:\s*(.+?)\s*-->\s*$")


def blocks(path: str) -> list[tuple[int, str, str | None]]:
    """``[(line, code, opt-out reason or None)]`` of the ```python blocks of ``path``."""
    text = open(os.path.join(ROOT, path), encoding="utf-8").read()
    out = []
    for m in _FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        before = [ln for ln in text[:m.start()].splitlines() if ln.strip()]
        reason = _OPT_OUT.search(before[-1]) if before else None
        out.append((line, m.group(1), reason.group(1) if reason else None))
    return out


def _count():
    ran = opted = 0
    for p in PAGES:
        for _, _, reason in blocks(p):
            ran, opted = ran + (reason is None), opted + (reason is not None)
    return ran, opted


@pytest.mark.parametrize("page", [p for p in PAGES if any(reason is None for _, _, reason in blocks(p))])
def test_page_python_blocks_run(page, tmp_path, monkeypatch):
    todo = [(line, code) for line, code, reason in blocks(page) if reason is None]
    monkeypatch.chdir(tmp_path)
    threads, rng = torch.get_num_threads(), torch.get_rng_state()
    ns = {"__name__": "__docs__"}
    try:
        for line, code in todo:
            try:
                exec(compile(code, f"{page}:{line}", "exec"), ns)
            except Exception as e:  # noqa: BLE001 - named with the page and line
                raise AssertionError(f"{page}, block at line {line}: {type(e).__name__}: {e}") from e
    finally:
        torch.set_num_threads(threads)
        torch.set_rng_state(rng)


def test_every_opt_out_gives_a_reason_and_most_blocks_run():
    ran, opted = _count()
    print(f"doc blocks: {ran} run, {opted} opted out")
    assert ran >= 3 * opted, (ran, opted)
