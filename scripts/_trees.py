"""Which source tree the scripts import ``megatron_hetero`` from, and temporary trees of other
revisions, so that one script can run the same code against two versions of the package.

The scripts import from the environment variable ``MEGATRON_HETERO_TREE`` when it is set,
else from their own repository. ``--against REV`` (scripts/check_behaviour.py,
scripts/bench_tuner.py) checks REV out into a temporary ``git worktree`` and runs the script
of the current tree in a subprocess with that variable (and ``PYTHONPATH``) pointing there:
the same measuring code, the package of the other revision, the inputs (examples/) of the
current tree.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENV = "MEGATRON_HETERO_TREE"


def use_tree() -> Path:
    """Put the tree to import ``megatron_hetero`` from first on ``sys.path`` and return it:
    ``$MEGATRON_HETERO_TREE`` when set, else this repository."""
    tree = Path(os.environ.get(ENV) or REPO).resolve()
    sys.path.insert(0, str(tree))
    return tree


def check_imported(tree: Path) -> None:
    """Fail loudly if ``megatron_hetero`` did not come from ``tree`` (an installed copy
    earlier on the path would make a comparison compare a tree with itself)."""
    import megatron_hetero
    got = Path(megatron_hetero.__file__).resolve()
    if tree not in got.parents:
        raise SystemExit(f"megatron_hetero imported from {got}, not from {tree}")


def tree_env(tree: Path) -> dict:
    """Environment for a subprocess that imports ``megatron_hetero`` from ``tree``."""
    env = dict(os.environ)
    env[ENV] = str(tree)
    env["PYTHONPATH"] = os.pathsep.join([str(tree)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, check=True, capture_output=True,
                          text=True).stdout.strip()


def describe(rev: str) -> str:
    """``rev`` as a short hash and subject line."""
    return _git("log", "-1", "--format=%h %s", rev)[:100]


@contextlib.contextmanager
def rev_tree(rev: str):
    """A temporary detached ``git worktree`` of ``rev`` (removed afterwards): yields its path."""
    sha = _git("rev-parse", "--verify", f"{rev}^{{commit}}")
    tmp = Path(tempfile.mkdtemp(prefix="mh-rev-"))
    path = tmp / "tree"
    _git("worktree", "add", "--detach", "--quiet", str(path), sha)
    try:
        yield path.resolve()
    finally:
        try:
            _git("worktree", "remove", "--force", str(path))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            _git("worktree", "prune")


@contextlib.contextmanager
def other_tree(rev: str | None, path: str | None):
    """The tree to compare with: a temporary worktree of ``rev``, or the existing ``path``."""
    if path is not None:
        tree = Path(path).resolve()
        if not (tree / "megatron_hetero" / "__init__.py").is_file():
            raise SystemExit(f"{tree}: no megatron_hetero package there")
        yield tree
    else:
        with rev_tree(rev) as tree:
            yield tree
