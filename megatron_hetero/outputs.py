"""The files a command writes: checked before any work, staged beside their targets, and put in
place together only once the whole command has succeeded.

``with Outputs(command, inputs={...}, outputs={...}) as out:`` refuses, before the work starts,
an output that is one of the inputs or another output (the same file by resolved path, symlink
or hard link), an output inside an input that is a folder (a checkpoint's own files), an output
whose folder does not exist or cannot be written, an output that is a folder or names one
(``newdir/``), a symlink loop, and a name the file system cannot hold (its staged file is
created and removed here, so a 255-byte name fails now, not after the search). An input found
only later (the old plan a checkpoint's arguments name) is checked the same way by
:meth:`Outputs.add_input`. Inside the block every writer writes to ``out.staged(path)``: a
hidden file in the target's folder with the target's extension (so writers that pick a format
from it still do); for a symlink, in the folder of the file it names, which is what is replaced
(the link stays). A target that names one of this process's open files (``/dev/stdout``,
``/dev/fd/2``, ``/proc/self/fd/N``) is written through that descriptor once the command has
succeeded, as the shell's redirection (``>> log``) asked, never replaced; another target that
exists and is neither a file nor a folder (``/dev/null``, a pipe) is written to directly.
When the block ends without an exception the staged files replace their targets (``os.replace``,
atomic on one file system), with SIGINT held back until the last one is in place, so that a
Ctrl-C never leaves some outputs new and others old; when it raises (a user error, a full disk,
Ctrl-C), or a Ctrl-C came that the interpreter swallowed (:mod:`.interrupts`), they are removed
and every existing file is as it was.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import Mapping

from . import interrupts
from .errors import HeteroError

__all__ = ["Outputs", "own_descriptor"]

_FD_LINK = re.compile(r"/(?:proc/(?:self|thread-self|(\d+))/fd|dev/fd)/(\d+)")
"""A path that names an open file descriptor of a process (``/dev/stdout`` links here)."""


def own_descriptor(path: str | Path) -> int | None:
    """The file descriptor of this process that ``path`` names through its chain of symlinks
    (``/dev/stdout`` -> ``/proc/self/fd/1``), or None; -1 for another process's descriptor
    (``/proc/PID/fd/N``), which no command may replace or write."""
    p = os.path.abspath(path)
    for _ in range(40):
        m = _FD_LINK.fullmatch(p)
        if m:
            return int(m.group(2)) if m.group(1) is None or int(m.group(1)) == os.getpid() else -1
        if not os.path.islink(p):
            head, tail = os.path.split(p)  # a folder on the way may be the link (/dev/fd)
            if head in ("", "/") or not tail:
                return None
            real_head = os.path.realpath(head)
            if real_head == head:
                return None
            p = os.path.join(real_head, tail)
            continue
        p = os.path.normpath(os.path.join(os.path.dirname(p), os.readlink(p)))
    return None


def _loop(name: str, path: Path) -> None:
    try:
        os.stat(path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise HeteroError(f"{name} {path}: a symlink loop ({exc.strerror}); expected a file "
                              "or a link to one") from None


def _same(a: Path, b: Path) -> bool:
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def _inside(path: Path, folder: Path) -> bool:
    """``path`` lies inside the folder ``folder`` (after symlinks)."""
    if not folder.is_dir():
        return False
    real, top = os.path.realpath(path), os.path.realpath(folder)
    return os.path.commonpath([real, top]) == top


def _name_max(folder: Path) -> int:
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def _staged_name(real: Path, limit: int) -> str:
    """``.STEM.partial-PID.EXT``, the stem cut so that the name fits ``limit`` bytes."""
    tail = f".partial-{os.getpid()}{real.suffix}"
    room = limit - len(os.fsencode(tail)) - 1
    stem = os.fsencode(real.stem)[:max(room, 0)].decode("utf-8", "ignore")
    return f".{stem}{tail}"


class Outputs:
    """The outputs of one command run (see the module docstring)."""

    def __init__(self, command: str, *, inputs: Mapping[str, str | None],
                 outputs: Mapping[str, str | None]):
        self.command = command
        for name, p in outputs.items():
            if p is not None and not str(p).strip():
                raise HeteroError(f"{name}: an empty path; expected a file name such as plan.yaml")
            if p and (str(p).endswith(("/", os.sep)) or Path(p).name in ("", ".", "..")):
                raise HeteroError(f"{name} {p}: a folder's path; expected a file path such as "
                                  f"{str(p).rstrip('/' + os.sep)}/plan.yaml (nothing was written)")
            if p:
                parent = Path(p).parent
                limit = _name_max(parent) if parent.is_dir() else 255
                size = len(os.fsencode(Path(p).name))
                if size > limit:
                    raise HeteroError(f"{name} {p}: a name of {size} bytes; expected at most "
                                      f"{limit} (this file system's limit; nothing was written)")
        self.targets = {name: Path(p) for name, p in outputs.items() if p}
        self._staged: dict[Path, Path] = {}
        self._streams: set[Path] = set()
        self._fds: dict[Path, int] = {}
        self._spool: Path | None = None
        self._inputs: dict[str, Path] = {}
        names = list(self.targets)
        for i, name in enumerate(names):
            path = self.targets[name]
            _loop(name, path)
            for other in names[:i]:
                if _same(path, self.targets[other]):
                    raise HeteroError(f"{name} {path}: it is also {other}; expected a separate "
                                      "file for each output (nothing was written)")
        for in_name, in_path in inputs.items():
            if in_path:
                self.add_input(in_name, in_path)
        for name in names:
            self._check_target(name, self.targets[name])

    def add_input(self, name: str, path: str | Path) -> None:
        """Refuse every output that is the input ``path`` or lies inside it (a folder); for an
        input found during the command (before anything is written)."""
        path = Path(path)
        _loop(name, path)
        self._inputs[name] = path
        for out_name, target in self.targets.items():
            if _same(target, path):
                raise HeteroError(f"{out_name} {target}: it is also the input {name}; expected "
                                  "an output path that is not one of the inputs (nothing was "
                                  "written)")
            if _inside(target, path):
                raise HeteroError(f"{out_name} {target}: it lies inside the input {name} "
                                  f"({path}); expected an output outside it (nothing was written)")

    def _check_target(self, name: str, path: Path) -> None:
        fd = own_descriptor(path)
        if fd == -1:
            raise HeteroError(f"{name} {path}: another process's open file; expected a file path "
                              "or one of this command's own streams (/dev/stdout)")
        if fd is not None:
            try:
                os.fstat(fd)
            except OSError:
                raise HeteroError(f"{name} {path}: descriptor {fd} is not open; expected a "
                                  "stream this command was given") from None
            self._fds[path] = fd  # written through the descriptor, as the shell redirected it
            return
        if path.is_dir():
            raise HeteroError(f"{name} {path}: a folder; expected a file path")
        if path.exists() and not path.is_file():
            self._streams.add(path)  # /dev/null, a pipe: written to, never replaced
            return
        real = Path(os.path.realpath(path))  # a symlink's file is what is written
        folder = real.parent
        if not folder.is_dir():
            raise HeteroError(f"{name} {path}: the folder {str(folder)!r} does not exist; "
                              "expected a path in an existing folder")
        if not os.access(folder, os.W_OK | os.X_OK):
            raise HeteroError(f"{name} {path}: the folder {str(folder)!r} is not writable; "
                              "expected a path this user can write")
        limit = _name_max(folder)
        if len(os.fsencode(real.name)) > limit:
            raise HeteroError(f"{name} {path}: a name of {len(os.fsencode(real.name))} bytes; "
                              f"expected at most {limit} (this file system's limit)")
        probe = folder / _staged_name(real, limit)
        try:  # what the writers will do at the end, tried before any work
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            os.unlink(probe)
        except OSError as exc:
            raise HeteroError(f"{name} {path}: cannot create a file beside it ({exc.strerror}); "
                              "expected a path this user can write (nothing was written)") from None

    def staged(self, target: str | Path) -> Path:
        """Where to write ``target`` (one of the outputs) until the command has succeeded: a
        hidden file beside it (beside the file a symlink names); a target that exists and is
        neither a file nor a folder (a device such as ``/dev/null``, a pipe) is itself."""
        target = Path(target)
        if target in self._streams:
            return target
        if target not in self._staged:
            if target in self._fds:
                if self._spool is None:
                    self._spool = Path(tempfile.mkdtemp(prefix="megatron-hetero-"))
                self._staged[target] = self._spool / f"out-{len(self._staged)}{target.suffix}"
            else:
                real = Path(os.path.realpath(target))
                self._staged[target] = real.parent / _staged_name(real, _name_max(real.parent))
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
                    if staged.exists() and target in self._fds:
                        self._write_through(self._fds[target], staged)
                    elif staged.exists():
                        os.replace(staged, os.path.realpath(target))
            except BaseException:
                self._discard()
                raise
            finally:
                if held:  # a Ctrl-C held back is raised now, with every output in place
                    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
            self._discard()  # the spool of descriptor outputs
            return False
        self._discard()
        if kind is None:
            raise KeyboardInterrupt
        return False

    @staticmethod
    def _write_through(fd: int, staged: Path) -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        data = staged.read_bytes()
        while data:
            data = data[os.write(fd, data):]

    def _discard(self) -> None:
        for staged in self._staged.values():
            try:
                staged.unlink()
            except FileNotFoundError:
                pass
        if self._spool is not None:
            shutil.rmtree(self._spool, ignore_errors=True)
