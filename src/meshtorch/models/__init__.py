"""Models built from meshtorch ops."""
