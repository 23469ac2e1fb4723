"""What goes wrong with a checkpoint, apart from ``format`` (which needs torch): the
emulator catches these without importing torch, so ``morphling --help`` stays quick."""


class CheckpointError(ValueError):
    """A checkpoint (or a model being converted) is missing, malformed or corrupt."""


class OutputError(CheckpointError):
    """The output path cannot take a checkpoint: the user's choice of path is wrong, not the
    model, so the command line says so with a usage error."""
