"""What can go wrong, sorted by whose fault it is, and the exit code each gets.

* Bad input (exit 3), refused before any work or communication: ``DumpError`` (a file that is
  not a fusion definition nvtp can read, with file and line), ``IRError`` (a malformed fusion),
  ``ShardingError`` (a plan or mesh that does not fit, naming tensor, axis and sizes),
  ``InputError`` (arguments unlike those a module was compiled for, or replicated inputs that
  differ between ranks), ``CaptureError`` (a model with operations nvtp cannot fuse).
* Failure at run time (exit 4): an op that fails, a rank that dies or hangs (``RankFailure``).

The classes live where they are raised (``nvtp.ir``, ``nvtp.sharding``); this module is light
(no torch) so the command line and the launcher can import it first.
"""

from __future__ import annotations

import sys

from nvtp.ir.ops import IRError
from nvtp.sharding.propagate import ShardingError

EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_USAGE = 2
EXIT_BAD_INPUT = 3
EXIT_RUNTIME = 4
EXIT_BROKEN_PIPE = 128 + 13  # the reader of stdout went away: the status of a command SIGPIPE stopped


class Usage(Exception):
    """A command line nvtp cannot read (exit 2): says which flags to give instead."""


class InputError(ValueError):
    """An argument that does not match what the module was compiled for (shape, dtype, device),
    or a replicated input that differs between ranks."""


class RankFailure(RuntimeError):
    """A rank of the mesh failed (an exception, a signal, a hang); says which and how. ``code``:
    the exit code its cause calls for (3 when every rank refused bad input, else 4)."""

    def __init__(self, message: str, code: int = EXIT_RUNTIME):
        super().__init__(message)
        self.code = code


def bad_input_types() -> tuple[type[BaseException], ...]:
    """The exception types that mean bad input (exit 3)."""
    from nvtp.ir.parser import DumpError  # lazy: kept off nvtp --help's path

    types: tuple[type[BaseException], ...] = (DumpError, IRError, ShardingError, InputError)
    capture = sys.modules.get("nvtp.frontend.capture")  # loaded with Thunder, only when something was traced
    if capture is not None:
        types += (capture.CaptureError,)  # a model with operations nvtp cannot fuse, named with their lines
    return types


def exit_code_for(e: BaseException) -> int:
    return EXIT_BAD_INPUT if isinstance(e, bad_input_types()) else EXIT_RUNTIME
