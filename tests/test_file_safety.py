"""Nothing lost: outputs that collide with inputs or with each other are refused before any work,
a failed, interrupted or out-of-space run leaves every existing file as it was; and strict
reading: duplicate keys, bytes that are not UTF-8, NaN and infinities (issue 18)."""

from __future__ import annotations

import errno
import json
import os
import time

import pytest

from megatron_hetero.cli import main
from megatron_hetero.outputs import Outputs

from .conftest import REPO, one_line_error

PLAN = REPO / "tests/data/plan_a100_v100.yaml"
INVENTORY = REPO / "examples/llama2/7b/inventory.yaml"
TUNE = ["--model", "llama2-7b", "--global-batch-size", "64", "--quiet"]


@pytest.fixture
def files(tmp_path):
    """An inventory, a plan and an old report in tmp_path, with their bytes."""
    inv, plan, report = tmp_path / "inv.yaml", tmp_path / "plan.yaml", tmp_path / "r.json"
    inv.write_bytes(INVENTORY.read_bytes())
    plan.write_bytes(PLAN.read_bytes())
    report.write_text('{"old": true}\n')
    return {p: p.read_bytes() for p in (inv, plan, report)}


def _unchanged(files) -> None:
    for path, data in files.items():
        assert path.read_bytes() == data, path
    leftovers = [p.name for p in next(iter(files)).parent.iterdir() if ".partial-" in p.name]
    assert not leftovers


@pytest.mark.parametrize("case", ["output is the inventory", "report is the inventory",
                                  "report is the plan", "plan through a symlink",
                                  "plan through a hard link", "json is the plan"])
def test_an_output_that_is_an_input_or_another_output_is_refused_first(case, files, tmp_path,
                                                                       capsys):
    inv, plan, report = (tmp_path / n for n in ("inv.yaml", "plan.yaml", "r.json"))
    (tmp_path / "link.yaml").symlink_to(plan)
    os.link(plan, tmp_path / "hard.yaml")
    argv = {
        "output is the inventory": ["tune", str(inv), *TUNE, "-o", str(inv)],
        "report is the inventory": ["tune", str(inv), *TUNE, "-o", str(plan), "--report", str(inv)],
        "report is the plan": ["tune", str(inv), *TUNE, "-o", str(plan), "--report", str(plan)],
        "plan through a symlink": ["tune", str(inv), *TUNE, "-o", str(plan),
                                   "--report", str(tmp_path / "link.yaml")],
        "plan through a hard link": ["tune", str(inv), *TUNE, "-o", str(plan),
                                     "--report", str(tmp_path / "hard.yaml")],
        "json is the plan": ["simulate", str(plan), "--inventory", str(inv), "--json", str(plan)],
    }[case]
    t0 = time.process_time()
    assert main(argv) == 1
    assert time.process_time() - t0 < 0.5  # refused before the search
    err = one_line_error(capsys, argv[0])
    assert "it is also" in err and "nothing was written" in err
    _unchanged(files)


def test_a_failing_writer_leaves_the_old_files(files, tmp_path, capsys, monkeypatch):
    """A full disk while the report is written: the old plan and report stay, no partial file."""
    inv, plan, report = (tmp_path / n for n in ("inv.yaml", "plan.yaml", "r.json"))
    real_dump = json.dump

    def full_disk(obj, f, **kw):
        real_dump({"partial": 1}, f)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(json, "dump", full_disk)
    assert main(["tune", str(inv), *TUNE, "-o", str(plan), "--report", str(report)]) == 1
    err = one_line_error(capsys, "tune")
    assert "No space left on device" in err and "every existing file is as it was" in err
    _unchanged(files)


def test_a_failing_timeline_leaves_the_old_plan(files, tmp_path, capsys, monkeypatch):
    from megatron_hetero.sim.step import SimResult

    inv, plan = tmp_path / "inv.yaml", tmp_path / "plan.yaml"

    def broken(self, path, **kw):
        raise KeyboardInterrupt  # Ctrl-C while the picture is drawn

    monkeypatch.setattr(SimResult, "timeline_png", broken)
    assert main(["tune", str(inv), *TUNE, "-o", str(plan), "--timeline",
                 str(tmp_path / "t.png")]) == 130
    assert capsys.readouterr().err == "megatron-hetero tune: interrupted\n"
    _unchanged(files)
    assert not (tmp_path / "t.png").exists()


def test_outputs_are_put_in_place_together_on_success(files, tmp_path):
    inv, plan, report = (tmp_path / n for n in ("inv.yaml", "plan.yaml", "r.json"))
    assert main(["tune", str(inv), *TUNE, "-o", str(plan), "--report", str(report),
                 "--timeline", str(tmp_path / "t.png")]) == 0
    assert plan.read_bytes() != files[plan] and json.loads(report.read_text())["megatron_args"]
    assert (tmp_path / "t.png").stat().st_size > 1000
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name]


@pytest.mark.parametrize("target, phrase", [("missing/p.yaml", "does not exist"),
                                            (".", "a folder")])
def test_output_folders_are_checked_before_the_search(target, phrase, files, tmp_path, capsys):
    assert main(["tune", str(tmp_path / "inv.yaml"), *TUNE, "-o", str(tmp_path / target)]) == 1
    assert phrase in one_line_error(capsys, "tune")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_folder_is_refused(files, tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    assert main(["tune", str(tmp_path / "inv.yaml"), *TUNE, "-o", str(ro / "p.yaml")]) == 1
    assert "not writable" in one_line_error(capsys, "tune")


def test_a_read_only_mount_is_refused_as_root_too(files, tmp_path):
    """The variant that runs as root (how CI runs), which writes through folder permissions:
    the folder is a read-only mount, which root cannot write either, in a mount namespace of
    its own (unshare) so that nothing outside the command sees it."""
    import shutil
    import subprocess
    import sys

    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("mounting needs root and unshare(1); test_a_read_only_folder_is_refused "
                    "covers other users")
    ro = tmp_path / "ro"
    ro.mkdir()
    tune = [sys.executable, "-m", "megatron_hetero.cli", "tune", str(tmp_path / "inv.yaml"),
            *TUNE, "-o", str(ro / "p.yaml")]
    proc = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                           f'mount -t tmpfs -o ro,size=1m tmpfs "{ro}" && exec "$@"', "sh",
                           *tune], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("megatron-hetero tune: error:"), proc.stderr
    assert "not writable" in lines[0]
    assert list(ro.iterdir()) == []  # the mount went with its namespace


def test_a_folder_the_access_check_refuses_is_refused(files, tmp_path, capsys, monkeypatch):
    """The refusal rests on the operating system's access check, whoever runs it: a folder that
    check calls unwritable (as it does for any user on a read-only mount) is refused."""
    ro = tmp_path / "ro"
    ro.mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: (
        not (mode & os.W_OK) and real(path, mode, **kw)) if os.path.realpath(path) == str(
            ro.resolve()) else real(path, mode, **kw))
    assert main(["tune", str(tmp_path / "inv.yaml"), *TUNE, "-o", str(ro / "p.yaml")]) == 1
    assert "not writable" in one_line_error(capsys, "tune")
    assert list(ro.iterdir()) == []


def test_outputs_remove_their_staged_files_on_any_exception(tmp_path):
    target = tmp_path / "a.yaml"
    target.write_text("old")
    with pytest.raises(RuntimeError):
        with Outputs("x", inputs={}, outputs={"-o": str(target)}) as out:
            out.staged(target).write_text("new")
            raise RuntimeError("boom")
    assert target.read_text() == "old" and list(tmp_path.iterdir()) == [target]


def test_pgf_timeline_without_latex_is_refused_naming_latex(files, tmp_path, capsys, monkeypatch):
    import shutil

    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert main(["tune", str(tmp_path / "inv.yaml"), *TUNE, "--timeline",
                 str(tmp_path / "t.pgf")]) == 1
    assert "needs LaTeX" in one_line_error(capsys, "tune")


# Ctrl-C at every moment, start-up included: tests/test_interrupts.py


# -- strict reading ----------------------------------------------------------------------------

def test_a_key_given_twice_names_both_lines(tmp_path, capsys):
    inv = tmp_path / "inv.yaml"
    inv.write_text("groups:\n  - {gpu: A100-SXM-80GB, nodes: 1, gpus_per_node: 8}\n"
                   "inter_group_bandwidth_gb_s: 10\n"
                   "groups:\n  - {gpu: V100-SXM2-32GB, nodes: 1, gpus_per_node: 8}\n")
    assert main(["tune", str(inv), *TUNE, "-o", str(tmp_path / "p.yaml")]) == 1
    err = one_line_error(capsys, "tune")
    assert "line 4" in err and "'groups' a second time (first on line 1)" in err


def test_a_key_given_twice_inside_a_flow_mapping(tmp_path, capsys):
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN.read_text().replace("precision: fp16", "precision: fp16\nprecision: bf16"))
    assert "precision: bf16" in plan.read_text()
    assert main(["validate", str(plan)]) == 1
    assert "'precision' a second time" in one_line_error(capsys, "validate")


@pytest.mark.parametrize("kind", ["plan", "inventory", "model"])
def test_bytes_that_are_not_utf8_name_the_file_and_offset(kind, tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    source = {"plan": PLAN, "inventory": INVENTORY}.get(kind, PLAN)
    bad.write_bytes(source.read_bytes()[:20] + b"\xff\xfe" + source.read_bytes()[20:])
    argv = {"plan": ["validate", str(bad)],
            "inventory": ["tune", str(bad), *TUNE, "-o", str(tmp_path / "p.yaml")],
            "model": ["tune", str(INVENTORY), "--model", str(bad), "--global-batch-size", "64",
                      "-o", str(tmp_path / "p.yaml")]}[kind]
    assert main(argv) == 1
    err = one_line_error(capsys, argv[0])
    assert f"{bad}: byte 20: found the byte 0xff, which is not UTF-8; expected a UTF-8" in err


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf", "1e999"])
def test_nan_and_infinities_are_refused_with_the_field_path(value, tmp_path, capsys):
    inv = tmp_path / "inv.yaml"
    inv.write_text("groups:\n  - {gpu: A100-SXM-80GB, nodes: 1, gpus_per_node: 8}\n"
                   f"inter_group_bandwidth_gb_s: {value}\n")
    assert main(["tune", str(inv), *TUNE, "-o", str(tmp_path / "p.yaml")]) == 1
    err = one_line_error(capsys, "tune")
    assert "inter_group_bandwidth_gb_s" in err and "expected a finite number" in err


def test_a_custom_gpu_with_nan_memory_names_the_file_and_field(tmp_path, capsys):
    inv = tmp_path / "inv.yaml"
    inv.write_text(
        "gpus:\n  X-1: {vendor: Acme, bf16_tflops: 100, bf16: true, fp32_tflops: 10, "
        "memory_gb: .nan, memory_bandwidth_gb_s: 1000, intra_node_link: PCIe4, "
        "intra_node_bandwidth_gb_s: 32, efficiency: 0.5}\n"
        "groups:\n  - {gpu: X-1, nodes: 1, gpus_per_node: 8}\n")
    assert main(["tune", str(inv), *TUNE, "-o", str(tmp_path / "p.yaml")]) == 1
    err = one_line_error(capsys, "tune")
    assert str(inv) in err and "memory_gb" in err and "finite" in err


# -- outputs that are not plain files ----------------------------------------------------------

def test_an_output_that_is_a_pipe_is_written_to_and_never_replaced(files, tmp_path, capsys):
    """``--json /dev/stdout`` (here a FIFO, as /dev/stdout is in a pipeline): the stream gets
    the JSON, and stays a stream (it was once replaced by a regular file)."""
    import stat
    import threading

    fifo = tmp_path / "stream"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()))
    reader.start()
    assert main(["simulate", str(REPO / "examples/llama2/7b/plan.yaml"), "--inventory",
                 str(tmp_path / "inv.yaml"), "--json", str(fifo)]) == 0
    reader.join(timeout=60)
    assert json.loads(got[0])["step_time_s"] > 0
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name]


def test_an_output_through_a_symlink_replaces_the_file_it_names(files, tmp_path):
    inv, plan = tmp_path / "inv.yaml", tmp_path / "plan.yaml"
    (tmp_path / "real").mkdir()
    real = tmp_path / "real/tuned.yaml"
    real.write_text("old\n")
    link = tmp_path / "link.yaml"
    link.symlink_to(real)
    assert main(["tune", str(inv), *TUNE, "-o", str(link)]) == 0
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert real.read_text().startswith("format_version: 1")
    assert not [p for p in (tmp_path / "real").iterdir() if ".partial-" in p.name]


def test_a_dangling_symlink_into_a_missing_folder_is_refused_first(files, tmp_path, capsys):
    link = tmp_path / "link.yaml"
    link.symlink_to(tmp_path / "nowhere/plan.yaml")
    assert main(["tune", str(tmp_path / "inv.yaml"), *TUNE, "-o", str(link)]) == 1
    assert "nowhere' does not exist" in one_line_error(capsys, "tune")
    assert link.is_symlink()


def test_an_empty_output_path_is_refused_first(files, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["tune", str(tmp_path / "inv.yaml"), *TUNE, "-o", ""]) == 1
    assert "-o/--output: an empty path" in one_line_error(capsys, "tune")
    _unchanged(files)
