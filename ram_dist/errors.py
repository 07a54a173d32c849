"""The project's own error types.

Every error a user can cause (bad input, bad parameters) is a `RamDistError`, so the CLI can
print its message and exit 2 without a traceback, and tests can tell our checks apart from
crashes. The message names the model, file and tensor and says what to do.
"""


class RamDistError(ValueError):
    """A problem with the user's input or parameters, found before or during a merge."""


class CheckpointError(RamDistError):
    """A checkpoint that cannot be read or does not fit the others."""
