"""Exception types raised at graph-build and lowering time.

Every message names the offending tensor, dimension or mesh axis and says what to do,
so that a user sees the problem where the graph is built, not deep inside torch.
"""


class MeshtorchError(Exception):
    """Base class of every error meshtorch raises on purpose."""


class ShapeError(MeshtorchError, ValueError):
    """A shape is malformed or two shapes cannot be combined (duplicate names, size clash)."""


class LayoutError(MeshtorchError, ValueError):
    """A layout rule cannot be applied: a size is not divisible, or two dims share a mesh axis."""


class FeedError(MeshtorchError, ValueError):
    """A value fed to ``Lowering.run`` does not match its placeholder."""


class DataError(MeshtorchError, ValueError):
    """An input data file is missing, truncated or malformed; the message names the file."""


class CheckpointError(MeshtorchError, ValueError):
    """A checkpoint cannot be written or read: corrupt or truncated file, missing variable, shape or
    dtype mismatch. The message names the variable and the file."""


class UsageError(MeshtorchError, ValueError):
    """A command-line flag or input path is invalid (exit status 2); the message names the flag."""


class RunFailure(MeshtorchError, RuntimeError):
    """A run that started correctly failed (divergence, a failed rank): the command exits with status 1."""
