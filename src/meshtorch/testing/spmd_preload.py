"""What :mod:`meshtorch.testing.spmd_start`'s fork server imports before it forks ranks (import it nowhere else).

torch and meshtorch, then :func:`gc.freeze`: the imported objects move to the collector's permanent generation,
so a rank's ``gc.collect()`` (``shutdown_distributed`` runs one) does not write to every one of them and copy
the server's heap page by page (measured: 0.7-1.3 s per rank of a 4-rank job on the 2-core host, 2026-11-28).
The recipe of the :func:`gc.freeze` documentation: collection disabled while importing, frozen before forking.
"""

import gc

gc.disable()
import torch  # noqa: E402, F401
import torch.distributed  # noqa: E402, F401

import meshtorch  # noqa: E402, F401
import meshtorch.testing.spmd  # noqa: E402, F401

gc.freeze()
gc.enable()
