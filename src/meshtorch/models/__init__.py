"""Models built from meshtorch layers."""
