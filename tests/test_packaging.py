"""pyproject.toml: a plain install (no extra) plans without torch or megatron-core.

The wheel is built from this checkout and installed with ``--no-deps`` into a folder of its
own; ``megatron-hetero tune`` then runs from there in a process where torch, megatron-core and
every other package outside the light dependencies cannot be imported (a finder refuses them),
and every third-party module it imported belongs to a declared light dependency or one of
theirs."""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from importlib import metadata

import pytest

from megatron_hetero.plan import load_plan

from .conftest import MCORE017, REPO

pytestmark = pytest.mark.slow  # builds a wheel

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
HEAVY = ("torch", "megatron", "triton", "matplotlib", "scipy", "einops", "psutil",
         "transformer_engine", "apex")
"""Import names a planning user need not have (the [runtime], [plot] and [te] extras)."""

_PROBE = """
import importlib.abc, json, sys
heavy = set(sys.argv[1].split(","))
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in heavy:
            raise ImportError(f"{name}: not part of a light install")
        return None
sys.meta_path.insert(0, Refuse())
import megatron_hetero
from megatron_hetero.cli import main
code = main(sys.argv[2:])
seen = {name.partition(".")[0] for name, m in list(sys.modules.items())
        if getattr(m, "__file__", None)} - set(sys.stdlib_module_names)  # files, not synthetic
seen -= {"megatron_hetero", "__main__"}
print("IMPORTED" + json.dumps([megatron_hetero.__file__, sorted(seen)]))
sys.exit(code)
"""


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _closure(requirements: list[str]) -> set[str]:
    """The distributions ``requirements`` pull in (their own non-extra requirements too), as
    installed here."""
    todo, done = [_name(r) for r in requirements], set()
    while todo:
        name = todo.pop()
        if name in done:
            continue
        done.add(name)
        for req in metadata.requires(name) or []:
            if "extra ==" not in req:
                todo.append(_name(req))
    return done


@pytest.fixture(scope="module")
def light_install(tmp_path_factory):
    """This checkout's wheel installed alone (``--no-deps``) into a folder."""
    tmp = tmp_path_factory.mktemp("light")
    src = tmp / "src"
    # build from a copy: an in-tree build would leave build/ behind in the checkout
    shutil.copytree(REPO, src, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "out", ".hypothesis", ".pytest_cache",
        "__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", str(src), "-w", str(tmp / "wheels")], check=True, capture_output=True,
                   timeout=300)
    (wheel,) = (tmp / "wheels").glob("megatron_hetero-*.whl")
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target",
                    str(tmp / "site"), str(wheel)], check=True, capture_output=True, timeout=300)
    return tmp


def test_plain_dependencies_name_neither_torch_nor_megatron_core():
    names = {_name(r) for r in PYPROJECT["project"]["dependencies"]}
    assert not names & {"torch", "megatron-core"}, names
    runtime = {_name(r) for r in PYPROJECT["project"]["optional-dependencies"]["runtime"]}
    assert {"torch", "megatron-core"} <= runtime, runtime


def _light(site, *argv) -> list:
    """``megatron-hetero ARGV`` from ``site`` with :data:`HEAVY` unimportable: (the package's
    file, the third-party modules it imported)."""
    # -S: no .pth of this venv (its editable install of the checkout); its packages after the
    # wheel's folder, every one of HEAVY refused
    path = os.pathsep.join([str(site), sysconfig.get_paths()["purelib"]])
    proc = subprocess.run([sys.executable, "-S", "-c", _PROBE, ",".join(HEAVY), *argv], cwd=site,
                          env={"PYTHONPATH": path, "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.split("IMPORTED", 1)[1])


def test_a_light_install_tunes_without_torch(light_install):
    """``megatron-hetero tune`` on the Llama-2 7B example, then ``validate`` of its plan against
    the inventory, from the installed wheel with torch, megatron-core and matplotlib
    unimportable; neither imported a third-party module outside the light dependencies and
    theirs."""
    site, out = light_install / "site", light_install / "plan.yaml"
    inventory = str(REPO / "examples/llama2/7b/inventory.yaml")
    runs = [_light(site, "tune", inventory, "--model", "llama2-7b", "--global-batch-size", "128",
                   "--seq-length", "4096", "-o", str(out)),
            _light(site, "validate", str(out), "--inventory", inventory)]
    allowed = _closure(PYPROJECT["project"]["dependencies"])
    owners = metadata.packages_distributions()
    assert {"numpy", "yaml"} <= set(runs[0][1])  # the finder saw the tuner's imports
    for package, imported in runs:
        assert package == str(site / "megatron_hetero" / "__init__.py")  # not the checkout
        for module in imported:
            dists = {_name(d) for d in owners.get(module, [])}
            assert dists & allowed, (module, dists, sorted(allowed))
    assert load_plan(str(out)).world_size > 0


def test_launch_docs_give_the_cpu_flags_the_runtime_tests_pass():
    """Issue 32 A.6: the Megatron-LM flags a CPU run needs were only in the tests; docs/launch.md
    gives them, and this keeps the two the same."""
    tests = (REPO / "tests/runtime/launching.py").read_text()
    base = ast.literal_eval(re.search(r"BASE_ARGS = (\[.*?\])\n", tests, re.S).group(1))
    doc = (REPO / "docs/launch.md").read_text()
    block = doc[doc.index("--transformer-impl local --no-gradient"):]
    block = block[:block.index("```")]
    given = block.split()
    cpu_only = ["--transformer-impl", "--no-gradient-accumulation-fusion",
                "--no-masked-softmax-fusion", "--no-bias-swiglu-fusion", "--no-rope-fusion",
                "--no-bias-dropout-fusion", "--no-persist-layer-norm", "--use-cpu-initialization",
                "--distributed-backend", "--num-workers"]
    for flag in cpu_only:
        assert flag in base, flag
        assert flag in given, flag
        i, j = base.index(flag), given.index(flag)
        if i + 1 < len(base) and not base[i + 1].startswith("--"):
            assert given[j + 1] == base[i + 1], flag
    assert "pybind11" in doc


def test_megatron_logs_its_first_iteration_without_resetting_the_loss_sums():
    """Issue 32 A.10: the first loss a resumed run logs after the first line is the mean of two
    iterations. docs/replan.md says it is Megatron-LM's `training_log` (which prints a run's first
    iteration and keeps summing); this fails when the bundled Megatron-LM stops doing so."""
    source = (MCORE017 / "megatron" / "training" / "training.py")
    if not source.is_file():
        pytest.skip(f"no megatron-core 0.17.1 at {MCORE017}")
    text = source.read_text()
    assert "should_reset = not is_first_iteration" in text
    assert "if iteration % args.log_interval == 0 or is_first_iteration:" in text
    assert "should_reset = not is_first_iteration" in (REPO / "docs/replan.md").read_text()
