"""Checkpoints that survive crashes and restore onto any mesh and layout, and interchange with
plain PyTorch state dicts.

- :mod:`~meshtorch.checkpoint.save`: :func:`save` (atomic, sharded safetensors files + manifest).
- :mod:`~meshtorch.checkpoint.restore`: :func:`restore` onto any mesh and layout.
- :mod:`~meshtorch.checkpoint.format`: constants, manifests, :func:`latest_checkpoint`.
- :mod:`~meshtorch.checkpoint.interchange`: :func:`to_torch_state_dict` / :func:`from_torch_state_dict`.
- :mod:`~meshtorch.checkpoint.hf`: Hugging Face GPT-2 / Llama directories in (:func:`hf.load`) and out
  (:func:`hf.export`), read and written slice by slice.

Checkpoints talk to a mesh implementation only through the ``MeshImpl`` interface
(``local_pnums``, ``local_slices``, ``owner_pnums``, ``barrier``, ``is_leader``). Format and
guarantees: ``docs/checkpoints.md``.
"""

from meshtorch.checkpoint.format import latest_checkpoint, load_manifest
from meshtorch.checkpoint.interchange import from_torch_state_dict, to_torch_state_dict
from meshtorch.checkpoint.restore import restore
from meshtorch.checkpoint.save import save
from meshtorch.core.errors import CheckpointError

__all__ = ["CheckpointError", "save", "restore", "latest_checkpoint", "to_torch_state_dict",
           "from_torch_state_dict", "load_manifest"]
