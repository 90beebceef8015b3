"""Ctrl-C on the command line: one line and exit 130 at any moment, start-up included, and
never a file half put in place.

Python turns SIGINT into a :class:`KeyboardInterrupt` raised wherever the interpreter happens
to be: inside an import of the CLI's modules before ``main`` has entered its ``try`` (a
traceback), or inside a callback the interpreter runs for itself (an import lock's, a
finaliser's), where it is printed as "Exception ignored" and lost, and the command goes on.
So the CLI handles SIGINT itself:

* :func:`defer`, the first thing the package does when the process is the CLI (:func:`is_cli`:
  the ``megatron-hetero`` script or ``python -m megatron_hetero.cli``; a library's import
  changes nothing): a SIGINT during start-up is only recorded;
* :func:`deliver`, the first thing ``main`` does inside its ``try``: from then on a SIGINT is
  recorded and raised as :class:`KeyboardInterrupt`, and one recorded during start-up is raised
  at once; :func:`pending` says whether one came, so that ``main`` still ends with exit 130 when
  the interpreter swallowed the exception, and :class:`~megatron_hetero.outputs.Outputs` puts
  nothing in place after one;
* :func:`restore` puts back the handler ``main`` found (a library caller's; the program's
  recording one, so that a Ctrl-C while the interpreter exits changes nothing).

Before the package's first line runs, the interpreter is starting (its ``site`` imports, some
20 ms): a SIGINT there ends the process as it ends any Python program (killed by the signal
before Python installs its handler, which the shell reports as 130; a traceback from Python's
own start-up after), with nothing written.
"""

from __future__ import annotations

import _signal as signal  # not ``signal``: it builds enums at import, milliseconds unguarded
import os
import sys

__all__ = ["is_cli", "defer", "deliver", "pending", "restore", "ignore"]

_state = {"pending": False, "previous": None, "ignored": False}


def is_cli(argv: list[str] | None = None) -> bool:
    """Whether this process's command line (``sys.orig_argv``) runs the CLI: the
    ``megatron-hetero`` script or ``python -m megatron_hetero.cli``."""
    argv = list(getattr(sys, "orig_argv", []) if argv is None else argv)[1:]
    while argv and argv[0].startswith("-") and argv[0] != "-m":  # interpreter options
        argv = argv[2:] if argv[0] in ("-X", "-W") else argv[1:]
    if argv[:2] == ["-m", "megatron_hetero.cli"]:
        return True
    return bool(argv) and os.path.basename(argv[0]).removesuffix(".exe") == "megatron-hetero"


def _set(handler) -> object:
    """``signal.signal``, or None off the main thread (a library may call ``main`` there)."""
    try:
        return signal.signal(signal.SIGINT, handler)
    except ValueError:
        return None


def _record(signum, frame) -> None:
    _state["pending"] = True


def _record_and_raise(signum, frame) -> None:
    _state["pending"] = True
    raise KeyboardInterrupt


def defer() -> None:
    """From now on only record a SIGINT (start-up, before ``main``'s ``try``). A process that
    was started with SIGINT ignored (a shell's background job, ``nohup``) keeps ignoring it, as
    every Unix program does."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        _state["ignored"] = True
        return
    _set(_record)


def deliver() -> None:
    """From now on record a SIGINT and raise :class:`KeyboardInterrupt`; raise it now if one
    was recorded during start-up. The handler found is kept for :func:`restore`. Nothing
    changes in a CLI process started with SIGINT ignored."""
    if _state["ignored"]:
        return
    _state["previous"] = _set(_record_and_raise)
    if _state["pending"]:
        raise KeyboardInterrupt


def pending() -> bool:
    """Whether a SIGINT came since start-up (or since the last :func:`restore`)."""
    return _state["pending"]


def ignore() -> None:
    """Ignore further SIGINTs (while the command says it was interrupted)."""
    _set(signal.SIG_IGN)


def restore() -> None:
    """Put back the handler :func:`deliver` found and forget a recorded SIGINT."""
    previous = _state["previous"]
    if previous is not None:
        _set(previous)
    _state["pending"], _state["previous"] = False, None
