"""crossbar's exceptions, raised for the C++ library's typed errors.

Each subclasses the builtin a caller would already catch (TimeoutError, ValueError,
NotImplementedError, ...) and CrossbarError; ``code`` names the C++ error code and
``peers`` the ranks the error is about.
"""

import builtins

__all__ = [
    "CrossbarError",
    "TimeoutError",
    "PeerFailure",
    "Aborted",
    "InvalidUsage",
    "InvalidArgument",
    "Unsupported",
    "SystemError",
]


class CrossbarError(RuntimeError):
    """Base of every crossbar error."""

    code = "internal"
    peers: list = []


class TimeoutError(CrossbarError, builtins.TimeoutError):  # noqa: A001 - deliberate shadowing
    """A deadline passed; ``peers`` never arrived."""


class PeerFailure(CrossbarError, ConnectionError):
    """Peers died or hung up."""


class Aborted(CrossbarError):
    """The communicator was aborted."""


class InvalidUsage(CrossbarError):
    """API misuse, or ranks disagree about a call."""


class InvalidArgument(CrossbarError, ValueError):
    """Bad input from the caller."""


class Unsupported(CrossbarError, NotImplementedError):
    """A valid request this build cannot do (dtype, reduce op, device)."""


class SystemError(CrossbarError, OSError):  # noqa: A001
    """An OS call failed."""
