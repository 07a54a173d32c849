"""The project's own error types.

Every error a user can act on is a `RamDistError`, so the CLI can print its message on one
line and exit with its `exit_status` without a traceback, and tests can tell our checks apart
from crashes. The message names the model, file and tensor and says what to do.
"""


class RamDistError(ValueError):
    """A problem with the user's input or parameters, found before or during a merge."""

    exit_status = 2
    """The CLI's exit status: 2, something the user must fix (input, parameters, paths)."""


class CheckpointError(RamDistError):
    """A checkpoint that cannot be read or does not fit the others."""


class StorageError(RamDistError):
    """A read or write that a store or disk refused or could not do, naming the input or
    output and the file (see `ram_dist.io.failures`). `exit_status` is 2 when the user must
    fix something (a missing file or bucket, a denied permission, refused credentials) and 1
    when the job failed for a reason that may pass (a full disk, a store still throttling
    or failing after its retries, a store out of reach)."""

    def __init__(self, message: str, exit_status: int = 2) -> None:
        super().__init__(message)
        self.exit_status = exit_status

    def __reduce__(self) -> tuple[type, tuple[str, int]]:
        # Raised on Ray workers and unpickled on the driver: keep the status with the message.
        return type(self), (str(self), self.exit_status)
