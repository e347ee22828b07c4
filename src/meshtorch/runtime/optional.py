"""Optional dependencies of the runtime (the ``meshtorch[cli]`` extra): the progress bar (tqdm) and
the loss-curve plot (matplotlib). The library below the runtime needs neither."""

from __future__ import annotations

import importlib

from meshtorch.core.errors import MeshtorchError


def optional_module(name: str, what: str):
    """Import module ``name`` (e.g. ``"tqdm"``), needed for ``what``.

    Raises:
        MeshtorchError: naming the package and the install command, if it is not installed.
    """
    try:
        return importlib.import_module(name)
    except ImportError:
        package = name.split(".")[0]
        raise MeshtorchError(f"{what} needs the '{package}' package: pip install 'meshtorch[cli]' "
                             f"(or pip install {package}).") from None
