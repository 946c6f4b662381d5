"""Bad input on the command line: one error line, exit status 2, for every ``hybridzoo`` command.

:mod:`hybridzoo.cli` (``eval``, ``generate``, ``convert``), :mod:`hybridzoo.training.cli`
(``fit`` / ``validate`` / ``test``) and :mod:`hybridzoo.training.evaluate` all report user
errors through these helpers; they live here so that none of those modules imports another
to reach them.
"""

from __future__ import annotations

import os
import sys


def user_errors(*extra: type[BaseException]) -> tuple[type[BaseException], ...]:
    """Exceptions that mean bad input (then ``extra``), reported in one line without a traceback
    (set the environment variable ``HYBRIDZOO_DEBUG=1`` to see the traceback): ``ValueError``
    (``ConfigError``, ``CheckpointError`` and the data modules' errors are ValueErrors),
    ``FileNotFoundError``, ``NotADirectoryError`` and Lightning's ``MisconfigurationException``."""
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    return (ValueError, FileNotFoundError, NotADirectoryError, MisconfigurationException, *extra)


def root_cause(error: BaseException, errors: tuple[type[BaseException], ...]) -> BaseException:
    """The innermost of ``error``'s chained exceptions that is one of ``errors``: jsonargparse
    wraps an error raised while building the data module in a long "Union subtypes" message.

    The chain is followed as Python prints it: ``__cause__`` (``raise ... from cause``), else
    ``__context__`` unless ``raise ... from None`` suppressed it, so that an error which replaced
    a library's message by a clearer one (a file name and line) is the one reported."""
    found, seen = error, set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, errors):
            found = error
        error = error.__cause__ if error.__cause__ is not None else (
            None if error.__suppress_context__ else error.__context__)
    return found


def user_error_exit(command: str, error: BaseException, errors: tuple[type[BaseException], ...] = ()) -> int:
    """Report a user error of ``hybridzoo <command>`` in one line on stderr and return exit status
    2 (its innermost cause among ``errors`` when given); ``HYBRIDZOO_DEBUG=1`` re-raises instead."""
    if os.environ.get("HYBRIDZOO_DEBUG"):
        raise error
    print(f"hybridzoo {command}: error: {root_cause(error, errors) if errors else error}", file=sys.stderr)
    return 2
