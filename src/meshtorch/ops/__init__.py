"""Operation families, one file each. Each Operation owns its shape inference, lower() and gradient()."""
