"""The compiled peers of ``scale_124m.py``'s ``dp_compile`` / ``fsdp_compile`` runs (PyTorch's documented recipes).

* ``ddp_compile``: ``torch.compile(DistributedDataParallel(model, bucket_cap_mb=25))``, DDP's compile path
  (``torch._dynamo.config.optimize_ddp`` on, its default: the DDPOptimizer splits the forward graph at the
  gradient buckets so the reducer's all-reduces still overlap the backward pass); the whole forward including
  the loss is compiled, the backward by AOTAutograd.
* ``fsdp2_compile``: TorchTitan's recipe (``torchtitan/models/llama3/infra/parallelize.py``: ``apply_compile``
  then ``apply_fsdp``): ``torch.compile`` each block, put the compiled block back in the module list, then
  ``fully_shard`` every (compiled) block and the root; FSDP2's all-gathers and reduce-scatters run in its hooks
  outside the compiled regions. The root's embedding lookup, final norm, logits and loss run eager, as in
  TorchTitan without its ``loss`` compile component.

The optimizer step: ``step_fn`` returns ``opt.step`` as it is for ``AdamW(fused=True)`` (one fused C++ kernel
over every parameter already; dynamo would trace it to the same ``_fused_adamw_`` call) and
``torch.compile(opt.step)`` for ``foreach`` / the default implementation (PyTorch's compiled-optimizer recipe:
inductor fuses the update into a few loops), so the peer's update is compiled or fused whenever meshtorch's
compiled program, which holds the whole step (forward, backward, collectives, AdamW), is.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def parallelize(model: nn.Module, run: str, ranks: int) -> nn.Module:
    """``model`` (a ``BlockLM`` with ``.blocks``) compiled and wrapped for ``run`` ``"ddp"`` or ``"fsdp2"``."""
    if run == "ddp":
        return torch.compile(nn.parallel.DistributedDataParallel(model, bucket_cap_mb=25))
    if run != "fsdp2":
        raise ValueError(f"compiled_peers.parallelize: run must be 'ddp' or 'fsdp2', got {run!r}.")
    for i, block in enumerate(model.blocks):  # TorchTitan's apply_compile: per block, before FSDP
        model.blocks[i] = torch.compile(block)
    mesh = init_device_mesh("cpu", (ranks,))
    for block in model.blocks:  # TorchTitan's apply_fsdp: every block, then the root
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def step_fn(opt: torch.optim.Optimizer):
    """The optimizer step to call: ``opt.step`` when fused, else ``torch.compile(opt.step)``."""
    if opt.defaults.get("fused"):
        return opt.step
    return torch.compile(opt.step)
