"""``megatron-hetero patch-megatron``: every release line's patch applies to its own
pretrain_gpt.py, is recognised once applied, and the patched script takes --hetero-plan."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_hetero.cli import main as cli_main
from megatron_hetero.runtime.patching import MARKER, PATCHES_DIR

from .launching import MEGATRON_GIT, needs_megatron_git

LINES = sorted(p.parent.name for p in PATCHES_DIR.glob("*/pretrain_gpt.patch"))
REFS = {"core_r0.16": "core_v0.16.1", "core_r0.17": "core_v0.17.1", "core_r0.18": "core_v0.18.2",
        "core_r0.19": "core_v0.19.0", "main": "main"}


def _old_side(patch: Path) -> str:
    """The lines a patch expects (its context and removed lines), as a minimal script."""
    out = []
    for line in patch.read_text().splitlines(keepends=True)[2:]:
        if line.startswith((" ", "-")):
            out.append(line[1:])
    return "".join(out)


def _checkout(tmp: Path, script: str, minor: int) -> Path:
    (tmp / "megatron" / "core").mkdir(parents=True)
    (tmp / "megatron" / "core" / "package_info.py").write_text(
        f"MAJOR = 0\nMINOR = {minor}\nPATCH = 0\n")
    (tmp / "pretrain_gpt.py").write_text(script)
    return tmp


def test_at_least_the_oldest_and_newest_lines_are_supported():
    assert {"core_r0.16", "main"} <= set(LINES)


@pytest.mark.parametrize("line", LINES)
def test_patch_applies_checks_and_is_recognised(tmp_path, line, capsys):
    minor = 99 if line == "main" else int(line.rsplit(".", 1)[1])
    root = _checkout(tmp_path, _old_side(PATCHES_DIR / line / "pretrain_gpt.patch"), minor)
    before = (root / "pretrain_gpt.py").read_text()
    assert cli_main(["patch-megatron", str(root), "--check"]) == 0
    assert (root / "pretrain_gpt.py").read_text() == before  # --check changes nothing
    assert cli_main(["patch-megatron", str(root)]) == 0
    assert MARKER in (root / "pretrain_gpt.py").read_text()
    assert cli_main(["patch-megatron", str(root)]) == 0
    assert "already patched" in capsys.readouterr().out


def test_unknown_version_and_foreign_script_are_clear_errors(tmp_path, capsys):
    root = _checkout(tmp_path / "a", "print('not pretrain_gpt')\n", 16)
    assert cli_main(["patch-megatron", str(root), "--check"]) == 1
    assert "core_r0.16 patch" in capsys.readouterr().err
    old = _checkout(tmp_path / "b", "x = 1\n", 9)
    assert cli_main(["patch-megatron", str(old)]) == 1
    err = capsys.readouterr().err
    assert "0.9.0 (core_r0.9) has no patch" in err and "megatron_hetero.launch" in err
    assert cli_main(["patch-megatron", str(tmp_path / "missing")]) == 1


@needs_megatron_git
@pytest.mark.parametrize("line", LINES)
def test_patch_applies_to_the_real_release(tmp_path, line):
    script = subprocess.run(["git", "--git-dir", str(MEGATRON_GIT), "show",
                             f"{REFS[line]}:pretrain_gpt.py"], capture_output=True, text=True,
                            check=True).stdout
    minor = 99 if line == "main" else int(line.rsplit(".", 1)[1])
    root = _checkout(tmp_path, script, minor)
    assert cli_main(["patch-megatron", str(root)]) == 0
    text = (root / "pretrain_gpt.py").read_text()
    assert text.index(MARKER) > text.index('if __name__ == "__main__":')


@needs_megatron_git
@pytest.mark.parametrize("line,found", [
    ("core_r0.18", "Megatron-LM core_r0.18 (megatron-core 0.18.x, 0.18.2 here)"),
    ("core_r0.19", "Megatron-LM core_r0.19 (megatron-core 0.19.x, 0.19.1 here)"),
    ("main", "Megatron-LM main (megatron-core 0.20.0, newer than every release line)")])
def test_check_says_which_release_it_found(tmp_path, line, found, capsys):
    """``patch-megatron --check`` on the stored releases' own pretrain_gpt.py and package_info.py
    (core_v0.19.0's package_info.py says 0.19.1) names the release line and megatron-core it
    found, and the patch it would apply."""
    files = subprocess.run(["git", "--git-dir", str(MEGATRON_GIT), "archive", REFS[line],
                            "pretrain_gpt.py", "megatron/core/package_info.py"],
                           capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tmp_path)], input=files, check=True)
    assert cli_main(["patch-megatron", str(tmp_path), "--check"]) == 0
    out = capsys.readouterr().out
    assert f"found {found}; the {line} patch applies cleanly" in out, out
    assert MARKER not in (tmp_path / "pretrain_gpt.py").read_text()


@needs_megatron_git
def test_patched_megatron_lm_takes_hetero_plan(tmp_path):
    """The patched pretrain_gpt.py of a Megatron-LM 0.17.1 checkout lists --hetero-plan."""
    archive = subprocess.run(["git", "--git-dir", str(MEGATRON_GIT), "archive", "core_v0.17.1"],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tmp_path)], input=archive, check=True)
    assert cli_main(["patch-megatron", str(tmp_path)]) == 0
    env = dict(os.environ, MEGATRON_HETERO_CPU="1",
               PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.run([sys.executable, "pretrain_gpt.py", "--help"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--hetero-plan PLAN" in proc.stdout and "--hetero-device-type" in proc.stdout


@pytest.mark.slow
def test_an_installed_wheel_ships_the_patches(tmp_path):
    """`patch-megatron` from a wheel install (no source checkout): the wheel carries every
    release line's patch as megatron_hetero/_patches and the module finds them there."""
    import shutil
    repo, src = Path(__file__).resolve().parents[2], tmp_path / "src"
    # build from a copy: an in-tree build would leave build/ behind in the checkout
    shutil.copytree(repo, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "out", ".hypothesis", ".pytest_cache",
        "__pycache__"))
    wheels, target = tmp_path / "wheels", tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    str(src), "-w", str(wheels)], check=True, capture_output=True, timeout=300)
    (wheel,) = wheels.glob("megatron_hetero-*.whl")
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target",
                    str(target), str(wheel)], check=True, capture_output=True, timeout=300)
    probe = ("from megatron_hetero.runtime.patching import PATCHES_DIR, _lines;"
             "print(PATCHES_DIR); print(' '.join(sorted(_lines())))")
    env = dict(os.environ, PYTHONPATH=str(target))
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, check=True,
                         capture_output=True, text=True, timeout=120).stdout.split("\n")
    assert Path(out[0]) == target / "megatron_hetero" / "_patches"
    assert out[1].split() == LINES
