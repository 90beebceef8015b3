"""Ctrl-C at any moment (issue 18, item 5): one line, exit 130, no traceback, every file as it
was and nothing partial, start-up included.

The CLI runs in a subprocess as a user runs it (``python -m megatron_hetero.cli``). To send the
signal at a known moment without sleeps that assume timing, a ``sitecustomize`` of the test's
own (on ``PYTHONPATH``, outside the product) stops the child at a named import and says so on
stderr (``HOLD_AT``), or says when a named function starts (``MARK_CALL``); the test reads that
line, then sends SIGINT.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from .conftest import REPO

PLAN = REPO / "tests/data/plan_a100_v100.yaml"
INVENTORY = REPO / "examples/llama2/7b/inventory.yaml"
BIG = REPO / "examples/scenarios/1024-h100-a100-a800-llama2-70b.yaml"

SITECUSTOMIZE = textwrap.dedent('''
    import importlib.machinery, os, sys, time

    HOLD_AT = os.environ.get("HOLD_AT")
    MARK_CALL = os.environ.get("MARK_CALL")  # module:function

    def _pending():
        mod = sys.modules.get("megatron_hetero.interrupts")
        return mod is not None and mod.pending()

    class _Finder:
        def find_spec(self, name, path=None, target=None):
            if name == HOLD_AT:
                sys.stderr.write(f"held at {name}\\n"); sys.stderr.flush()
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline and not _pending():
                    time.sleep(0.01)  # a KeyboardInterrupt raised here is the product's
            if MARK_CALL and name == MARK_CALL.split(":")[0]:
                spec = importlib.machinery.PathFinder.find_spec(name, path)
                run = spec.loader.exec_module
                def exec_module(module):
                    run(module)
                    func_name = MARK_CALL.split(":")[1]
                    func = getattr(module, func_name)
                    def marked(*a, **kw):
                        sys.stderr.write(f"called {MARK_CALL}\\n"); sys.stderr.flush()
                        return func(*a, **kw)
                    setattr(module, func_name, marked)
                spec.loader.exec_module = exec_module
                return spec
            return None

    sys.meta_path.insert(0, _Finder())
''')


@pytest.fixture
def files(tmp_path):
    """Inputs and old outputs in tmp_path, with their bytes; a sitecustomize beside them."""
    from megatron_hetero._schema import read_yaml, write_yaml

    (tmp_path / "site").mkdir()
    (tmp_path / "site/sitecustomize.py").write_text(SITECUSTOMIZE)
    inv, big = tmp_path / "inv.yaml", tmp_path / "big.yaml"
    inv.write_bytes(INVENTORY.read_bytes())
    write_yaml(read_yaml(BIG)["inventory"], big)
    (tmp_path / "plan.yaml").write_bytes(PLAN.read_bytes())
    (tmp_path / "r.json").write_text('{"old": true}\n')
    return {p: p.read_bytes() for p in sorted(tmp_path.iterdir()) if p.is_file()}


def _unchanged(files, tmp_path) -> None:
    for path, data in files.items():
        assert path.read_bytes() == data, path
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [p.name for p in files] + ["site"])  # nothing partial, nothing new


def _spawn(tmp_path, argv, *, sigint=signal.SIG_DFL, own_group: bool = False, **env):
    """The CLI as a user runs it; its SIGINT disposition is ``sigint`` whatever this test run
    inherited (a background job's is "ignored"); ``own_group``: in a process group of its own,
    as a terminal's foreground job is, so that the test can signal the group."""
    return subprocess.Popen(
        [sys.executable, "-m", "megatron_hetero.cli", *argv], stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(REPO)]),
             **env},
        preexec_fn=lambda: signal.signal(signal.SIGINT, sigint), start_new_session=own_group)


def _tune(tmp_path, *, big: bool = True):
    """A tune writing over plan.yaml and r.json, and a new timeline; on the 1024-GPU pool (a
    search of seconds) or on the 16-GPU one."""
    model = ["big.yaml", "llama2-70b", "2048"] if big else ["inv.yaml", "llama2-7b", "64"]
    return ["tune", str(tmp_path / model[0]), "--model", model[1], "--global-batch-size",
            model[2], "--quiet", "-o", str(tmp_path / "plan.yaml"), "--report",
            str(tmp_path / "r.json"), "--timeline", str(tmp_path / "t.png")]


def _interrupted(proc, command: str) -> None:
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert err == f"{command}: interrupted\n", err


@pytest.mark.parametrize("hold_at, command", [
    # start-up: the package's own imports, then the CLI module's, before main() runs
    ("megatron_hetero._version", "megatron-hetero"),
    ("argparse", "megatron-hetero"),
    ("megatron_hetero.errors", "megatron-hetero"),
    # inside main(): the parser's imports
    ("megatron_hetero.tuner.commands", "megatron-hetero"),
    # after the search, with the plan and the report staged: the timeline's matplotlib
    ("matplotlib.pyplot", "megatron-hetero tune"),
])
def test_ctrl_c_during_imports_is_one_line_and_exit_130(hold_at, command, files, tmp_path):
    proc = _spawn(tmp_path, _tune(tmp_path, big=False), HOLD_AT=hold_at)
    assert proc.stderr.readline() == f"held at {hold_at}\n"
    proc.send_signal(signal.SIGINT)
    _interrupted(proc, command)
    _unchanged(files, tmp_path)


def test_ctrl_c_during_the_search_is_one_line_and_exit_130(files, tmp_path):
    """The 1024-GPU search takes seconds; SIGINT once it has started."""
    proc = _spawn(tmp_path, _tune(tmp_path), MARK_CALL="megatron_hetero.tuner.search:tune")
    assert proc.stderr.readline() == "called megatron_hetero.tuner.search:tune\n"
    proc.send_signal(signal.SIGINT)
    _interrupted(proc, "megatron-hetero tune")
    _unchanged(files, tmp_path)


def test_a_command_started_with_sigint_ignored_keeps_ignoring_it(files, tmp_path):
    """``nohup megatron-hetero tune ... &``: a SIGINT to it changes nothing, as for any program
    started so; the tune ends and puts its outputs in place."""
    proc = _spawn(tmp_path, _tune(tmp_path, big=False), sigint=signal.SIG_IGN,
                  MARK_CALL="megatron_hetero.tuner.search:tune")
    assert proc.stderr.readline() == "called megatron_hetero.tuner.search:tune\n"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert (tmp_path / "plan.yaml").read_bytes() != files[tmp_path / "plan.yaml"]
    assert (tmp_path / "t.png").is_file()


@pytest.mark.slow
def test_ctrl_c_to_the_terminals_group_as_rehearse_starts_its_ranks(files, tmp_path):
    """A terminal's Ctrl-C reaches the CPU ranks too. Sent as they start: one line and 130, and
    no rank prints a traceback of its own, neither a KeyboardInterrupt nor, forked after the
    command has gone, a failure to read the queue's lock."""
    proc = _spawn(tmp_path, ["rehearse", str(tmp_path / "plan.yaml"), "--steps", "2"],
                  own_group=True, MARK_CALL="multiprocessing.forkserver:connect_to_new_process")
    assert proc.stderr.readline() == "[rehearse] calibrating the CPU and gloo\n"
    # the first rank asked of the server, which is still importing torch and megatron-core
    assert proc.stderr.readline() == \
        "called multiprocessing.forkserver:connect_to_new_process\n"
    time.sleep(1.0)  # inside the server's imports (seconds); anywhere later must be as clean
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    err = "".join(line for line in err.splitlines(keepends=True)
                  if not line.startswith("called multiprocessing"))  # the marker, per rank
    assert proc.returncode == 130 and err == "megatron-hetero rehearse: interrupted\n", err


def test_ctrl_c_while_validating(files, tmp_path):
    proc = _spawn(tmp_path, ["validate", str(tmp_path / "plan.yaml"), "--inventory",
                             str(tmp_path / "inv.yaml")],
                  MARK_CALL="megatron_hetero.cli.plan_commands:validate_main")
    assert proc.stderr.readline() == "called megatron_hetero.cli.plan_commands:validate_main\n"
    proc.send_signal(signal.SIGINT)
    _interrupted(proc, "megatron-hetero validate")


@pytest.mark.parametrize("hold_at, handled", [
    ("megatron_hetero", False),  # the interpreter's start-up, before the package's first line
    ("megatron_hetero.interrupts", False),  # the package's first line: the handler's module
    ("megatron_hetero._version", True),  # the handler installed: the package's own answer
])
def test_ctrl_c_at_start_up_is_pythons_until_the_handler_then_one_line(hold_at, handled, files,
                                                                       tmp_path):
    """SIGINT at each moment of start-up, held there (not raced against the spawn): before the
    package's handler is installed the process dies of the signal with Python's own traceback,
    which names no file of the package but its first line (the import of the handler's
    module); from the next import on it is one line and 130. Either way no file changed."""
    proc = _spawn(tmp_path, _tune(tmp_path), HOLD_AT=hold_at)
    assert proc.stderr.readline() == f"held at {hold_at}\n"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    if handled:
        assert proc.returncode == 130 and err == "megatron-hetero: interrupted\n", err
    else:
        assert proc.returncode == -signal.SIGINT, err
        assert err.startswith("Traceback") and err.rstrip().endswith("KeyboardInterrupt"), err
        package = [line.strip() for line in err.splitlines()
                   if f"{os.sep}megatron_hetero{os.sep}" in line]
        first = f'File "{REPO / "megatron_hetero" / "__init__.py"}", line'
        assert all(line.startswith(first) for line in package), err
        assert len(package) == (hold_at != "megatron_hetero"), err
        if package:
            assert "from . import interrupts" in err.split(package[0], 1)[1].splitlines()[1]
    _unchanged(files, tmp_path)


def test_a_ctrl_c_the_interpreter_swallowed_still_ends_with_130_and_no_output(tmp_path, capsys,
                                                                           monkeypatch):
    """Python drops a KeyboardInterrupt raised inside some of its own callbacks ("Exception
    ignored in ..."); the command must not then go on to put its outputs in place or exit 0."""
    from megatron_hetero.cli import plan_commands as commands
    from megatron_hetero.cli import main
    from megatron_hetero.outputs import Outputs

    found = signal.getsignal(signal.SIGINT)
    target = tmp_path / "out.json"
    target.write_text("old")

    def swallowing(args):
        with Outputs("validate", inputs={}, outputs={"--json": str(target)}) as out:
            out.staged(target).write_text("new")
            try:
                os.kill(os.getpid(), signal.SIGINT)
                for _ in range(10**6):  # the handler runs at the next bytecode boundary
                    pass
            except KeyboardInterrupt:
                pass  # as the interpreter's callback would
        return 0

    monkeypatch.setattr(commands, "validate_main", swallowing)
    assert main(["validate", str(PLAN)]) == 130
    assert capsys.readouterr().err == "megatron-hetero validate: interrupted\n"
    assert target.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]
    assert signal.getsignal(signal.SIGINT) is found  # put back
