"""The package version (one place: ``meshtorch.__version__`` and checkpoint manifests read it)."""

__version__ = "0.1.0"
