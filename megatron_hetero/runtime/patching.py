"""``megatron-hetero patch-megatron PATH [--check]``: add ``--hetero-plan`` to a Megatron-LM
checkout's ``pretrain_gpt.py`` with the patch of its release line (``patches/<line>/``).

The patch only installs the hooks of :mod:`megatron_hetero.runtime.hooks` at the top of the
script's ``__main__`` block; it is applied with GNU ``patch`` (``git apply`` where ``patch`` is
missing). No torch or megatron import happens here.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
from pathlib import Path

from ..errors import HeteroError

__all__ = ["PATCHES_DIR", "release_line", "patch_for", "found_release", "apply_patch",
           "patch_megatron_main", "MARKER"]

def _patches_dir() -> Path:
    """``patches/`` of a source checkout, else the copy an installed wheel ships as
    ``megatron_hetero/_patches`` (a link in the package points at it, so a wheel carries it)."""
    here = Path(__file__).resolve().parents[1]
    checkout = here.parent / "patches"
    return checkout if checkout.is_dir() else here / "_patches"


PATCHES_DIR = _patches_dir()
MARKER = "install_megatron_hetero()"
"""Text the patched script contains (how an already patched checkout is recognised)."""


def _lines() -> dict[str, Path]:
    if not PATCHES_DIR.is_dir():
        raise HeteroError(f"the patches directory {PATCHES_DIR} is missing (reinstall "
                          f"megatron-hetero: its wheel ships the patches as megatron_hetero/_patches)")
    return {p.parent.name: p for p in sorted(PATCHES_DIR.glob("*/pretrain_gpt.patch"))}


def release_line(megatron: Path) -> tuple[str, str]:
    """(release line, version) of a Megatron-LM checkout, e.g. ``("core_r0.16", "0.16.1")``."""
    info = megatron / "megatron" / "core" / "package_info.py"
    if not info.is_file():
        raise HeteroError(f"{megatron}: not a Megatron-LM checkout (no megatron/core/package_info.py)")
    text = info.read_text()
    parts = {}
    for key in ("MAJOR", "MINOR", "PATCH"):
        found = re.search(rf"^{key}\s*=\s*(\d+)", text, re.M)
        if not found:
            raise HeteroError(f"{info}: no {key} = N line; cannot tell the release line")
        parts[key] = int(found.group(1))
    version = f"{parts['MAJOR']}.{parts['MINOR']}.{parts['PATCH']}"
    return f"core_r{parts['MAJOR']}.{parts['MINOR']}", version


def patch_for(megatron: Path) -> tuple[str, Path]:
    """The patch of the checkout's release line; ``main`` for a version newer than every line."""
    lines = _lines()
    line, version = release_line(megatron)
    if line in lines:
        return line, lines[line]
    released = sorted((tuple(int(x) for x in name[len("core_r"):].split(".")), name)
                      for name in lines if name.startswith("core_r"))
    if "main" in lines and released and tuple(int(x) for x in version.split(".")[:2]) > released[-1][0]:
        return "main", lines["main"]
    raise HeteroError(f"{megatron}: Megatron-LM {version} ({line}) has no patch; supported release "
                      f"lines: {', '.join(lines)} (or run it unpatched: python -m "
                      f"megatron_hetero.launch {megatron / 'pretrain_gpt.py'} ... --hetero-plan PLAN)")


def found_release(megatron: Path, line: str) -> str:
    """What ``patch-megatron`` says it found: ``"Megatron-LM core_r0.19 (megatron-core 0.19.x,
    0.19.1 here)"``, or for a checkout newer than every release line ``"Megatron-LM main
    (megatron-core 0.20.0, newer than every release line)"``."""
    _, version = release_line(megatron)
    if line == "main":
        return f"Megatron-LM main (megatron-core {version}, newer than every release line)"
    series = ".".join(version.split(".")[:2])
    return f"Megatron-LM {line} (megatron-core {series}.x, {version} here)"


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)


def apply_patch(megatron: Path, patch: Path, *, check: bool) -> subprocess.CompletedProcess:
    """Apply (or with ``check`` only test) ``patch`` in ``megatron``."""
    if shutil.which("patch"):
        cmd = ["patch", "-p1", "--forward", "--batch", "--no-backup-if-mismatch", "-i", str(patch)]
        if check:
            cmd.insert(1, "--dry-run")
    elif shutil.which("git"):
        cmd = ["git", "apply", "-p1", str(patch)] + (["--check"] if check else [])
    else:
        raise HeteroError("patch-megatron needs GNU patch or git on PATH")
    return _run(cmd, megatron)


def patch_megatron_main(args: argparse.Namespace) -> int:
    megatron = Path(args.path)
    script = megatron / "pretrain_gpt.py"
    if not script.is_file():
        raise HeteroError(f"{megatron}: no pretrain_gpt.py (give the Megatron-LM checkout's root)")
    line, patch = patch_for(megatron)
    found = found_release(megatron, line)
    if MARKER in script.read_text():
        print(f"{script}: already patched for megatron-hetero; found {found}")
        return 0
    result = apply_patch(megatron, patch, check=True)  # never leave a half-patched checkout
    if result.returncode == 0 and not args.check:
        result = apply_patch(megatron, patch, check=False)
    if result.returncode != 0:
        said = "; ".join(x.strip() for x in (result.stdout + result.stderr).splitlines()
                         if x.strip() and not x.startswith("checking file"))
        raise HeteroError(f"{script}: the {line} patch ({patch}) does not apply ({said}); "
                          f"expected that release's unmodified pretrain_gpt.py (or run it "
                          f"unpatched: python -m megatron_hetero.launch {script} ...)")
    if args.check:
        print(f"{script}: found {found}; the {line} patch applies cleanly ({patch})")
    else:
        print(f"{script}: found {found}; patched ({line}); run it with --hetero-plan PLAN")
    return 0
