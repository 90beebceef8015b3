"""The files a command writes: checked before any work, staged beside their targets, and put in
place together only once the whole command has succeeded.

``with Outputs(command, inputs={...}, outputs={...}) as out:`` refuses, before the work starts,
an output that is one of the inputs or another output (the same file by resolved path, symlink
or hard link), an output whose folder does not exist or cannot be written, and an output that
is a folder. Inside the block every writer writes to ``out.staged(path)``: a hidden file in the
target's folder with the target's extension (so writers that pick a format from it still do);
for a symlink, in the folder of the file it names, which is what is replaced (the link stays);
a target that exists and is neither a file nor a folder (``/dev/stdout``, ``/dev/null``, a
pipe) is written to directly and never replaced.
When the block ends without an exception the staged files replace their targets (``os.replace``,
atomic on one file system), with SIGINT held back until the last one is in place, so that a
Ctrl-C never leaves some outputs new and others old; when it raises (a user error, a full disk,
Ctrl-C), or a Ctrl-C came that the interpreter swallowed (:mod:`.interrupts`), they are removed
and every existing file is as it was.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Mapping

from . import interrupts
from .errors import HeteroError

__all__ = ["Outputs"]


def _same(a: Path, b: Path) -> bool:
    if a.resolve() == b.resolve():
        return True
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


class Outputs:
    """The outputs of one command run (see the module docstring)."""

    def __init__(self, command: str, *, inputs: Mapping[str, str | None],
                 outputs: Mapping[str, str | None]):
        self.command = command
        for name, p in outputs.items():
            if p is not None and not str(p).strip():
                raise HeteroError(f"{name}: an empty path; expected a file name such as plan.yaml")
        self.targets = {name: Path(p) for name, p in outputs.items() if p}
        self._staged: dict[Path, Path] = {}
        self._streams: set[Path] = set()
        ins = {name: Path(p) for name, p in inputs.items() if p}
        names = list(self.targets)
        for i, name in enumerate(names):
            path = self.targets[name]
            for in_name, in_path in ins.items():
                if _same(path, in_path):
                    raise HeteroError(f"{name} {path}: it is also the input {in_name}; expected "
                                      "an output path that is not one of the inputs (nothing "
                                      "was written)")
            for other in names[:i]:
                if _same(path, self.targets[other]):
                    raise HeteroError(f"{name} {path}: it is also {other}; expected a separate "
                                      "file for each output (nothing was written)")
            if path.is_dir():
                raise HeteroError(f"{name} {path}: a folder; expected a file path")
            if path.exists() and not path.is_file():
                self._streams.add(path)  # /dev/stdout, a pipe: written to, never replaced
                continue
            folder = Path(os.path.realpath(path)).parent  # a symlink's file is what is written
            if not folder.is_dir():
                raise HeteroError(f"{name} {path}: the folder {str(folder)!r} does not exist; "
                                  "expected a path in an existing folder")
            if not os.access(folder, os.W_OK | os.X_OK):
                raise HeteroError(f"{name} {path}: the folder {str(folder)!r} is not writable; "
                                  "expected a path this user can write")

    def staged(self, target: str | Path) -> Path:
        """Where to write ``target`` (one of the outputs) until the command has succeeded: a
        hidden file beside it (beside the file a symlink names); a target that exists and is
        neither a file nor a folder (a device such as ``/dev/stdout``, a pipe) is itself."""
        target = Path(target)
        if target in self._streams:
            return target
        if target not in self._staged:
            real = Path(os.path.realpath(target))
            self._staged[target] = real.parent / f".{real.stem}.partial-{os.getpid()}{real.suffix}"
        return self._staged[target]

    def __enter__(self) -> "Outputs":
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        if kind is None and not interrupts.pending():
            held = hasattr(signal, "pthread_sigmask")
            if held:
                signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            try:
                for target, staged in self._staged.items():
                    if staged.exists():
                        os.replace(staged, os.path.realpath(target))
            except BaseException:
                self._discard()
                raise
            finally:
                if held:  # a Ctrl-C held back is raised now, with every output in place
                    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
            return False
        self._discard()
        if kind is None:
            raise KeyboardInterrupt
        return False

    def _discard(self) -> None:
        for staged in self._staged.values():
            try:
                staged.unlink()
            except FileNotFoundError:
                pass
