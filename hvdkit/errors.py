"""One error type for everything a user can get wrong.

Every message is a single line that says what was wrong and ends with a
``HINT:`` that says how to fix it. The CLI prints ``str(err)`` and exits 2;
library users can catch :class:`HvdkitError`.
"""

from __future__ import annotations

# hvdkit train's exit status when the loss went non-finite (hvdkit.nonfinite): a run that would
# do the same again (the same data, weights and seed), so a sweep does not retry it
# (hvdkit.rayrun.tune). 65 is EX_DATAERR in sysexits.h.
EXIT_NONFINITE = 65


class HvdkitError(RuntimeError):
    """A user-facing error: one line, what went wrong, then ``HINT: fix``.

    ``echo`` is False on the ranks that should stay quiet when every rank raises
    the same error (a collective decision): the CLI then exits 1 without printing.
    """

    echo: bool = True
    exit_code: int = 1  # the command's exit status when this ends it

    def __init__(self, message: str, hint: str | None = None) -> None:
        self.message = " ".join(message.split())
        self.hint = " ".join(hint.split()) if hint else None
        super().__init__(self.message + (f" HINT: {self.hint}" if self.hint else ""))


def first_line(exc: BaseException, limit: int | None = 200, default: str | None = None) -> str:
    """The first line of ``str(exc)`` (``default``, else the type's name, when it is empty), cut to ``limit``.

    What a one-line error quotes of a library's exception: h5py, click, c10d and yaml
    put several lines or a whole traceback into their messages.
    """
    text = str(exc).strip()
    line = text.splitlines()[0] if text else (type(exc).__name__ if default is None else default)
    return line[:limit] if limit is not None else line


class ConfigError(HvdkitError, ValueError):
    """A configuration value is invalid."""


class LauncherEnvError(HvdkitError):
    """The launcher environment (Slurm, MPI, torchrun variables) is inconsistent."""


class BackendUnavailableError(HvdkitError, ImportError):
    """The requested backend cannot be used on this installation."""


class CheckpointError(HvdkitError):
    """A checkpoint could not be written, found, or verified."""
