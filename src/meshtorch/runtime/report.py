"""What ``meshtorch train`` reports besides the progress bar: when ``--compile`` compiles (and which steps to
leave out of throughput), and the loss-curve plot."""

from __future__ import annotations

import math
import os
import textwrap

from meshtorch.runtime.optional import optional_module


class CompileClock:
    """Which steps of a ``--compile`` run compiled (``Session.compile_seconds`` grew): says when compiling
    starts and ends, restarts the progress bar's clock after a compiling step (its ETA and rate then count
    steady-state steps only), and adds up the wall seconds and training steps to leave out of throughput."""

    def __init__(self, session, bar, write):
        self.session, self.bar, self.write = session, bar, write
        self.seconds, self.steps, self.parts = 0.0, 0, []
        self._known, self._announced = 0, set()

    def before(self, what: str, session=None):
        """Call before running ``what`` (e.g. ``"training step"``) on ``session`` (default: the training one):
        announces the first compilation of each kind of step."""
        session = session or self.session
        self._known = len(session.compile_seconds)
        if session.mode == "compile" and what not in self._announced:
            self._announced.add(what)
            self.write(f"compiling the {what} with torch.compile (tens of seconds on a CPU) ...")

    def after(self, what: str, dt: float, steps: int, session=None):
        """Call after the run that took ``dt`` seconds: if it compiled, says how long, counts ``dt`` and
        ``steps`` training steps as compile time, and restarts the bar's rate and ETA."""
        session = session or self.session
        new = list(session.compile_seconds.values())[self._known:]
        if not new:
            return
        if all(v is None for v in new):
            self.write(f"the {what} has random ops (dropout): it runs uncompiled")
            return
        self.seconds += dt
        self.steps += steps
        self.parts.append((what, dt))
        self.write(f"compiled the {what} in {sum(v for v in new if v is not None):.1f} s")
        n = self.bar.n
        self.bar.reset(total=self.bar.total)  # the rate and ETA restart after compiling
        self.bar.initial = self.bar.n = self.bar.last_print_n = n

    def describe(self) -> str:
        """``"training step 47.9 s, evaluation step 1.5 s"``: the wall seconds of each compiling run."""
        return ", ".join(f"{w} {s:.1f} s" for w, s in self.parts)


def plot_history(history: dict, path: str, bytes_per_token: float = 1.0, title: str = "") -> None:
    """Write the loss curve of ``history`` (``step``/``loss``, ``val_step``/``val_loss`` in nats per token) as a
    PNG at ``path``, in bits per byte; ``title`` is wrapped to fit the figure.

    Raises:
        MeshtorchError: if matplotlib (the ``meshtorch[cli]`` extra) is not installed.
    """
    matplotlib = optional_module("matplotlib", "meshtorch train --plot")
    matplotlib.use("Agg")
    plt = optional_module("matplotlib.pyplot", "meshtorch train --plot")

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    k = 1.0 / math.log(2) / bytes_per_token
    ax.plot(history["step"], [v * k for v in history["loss"]], lw=0.8, label="train")
    ax.plot(history["val_step"], [v * k for v in history["val_loss"]], "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("bits per byte")
    ax.set_title(textwrap.fill(title, 80), fontsize=9)  # wrapped: a long layout never runs off the figure
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

