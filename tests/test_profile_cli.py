"""`megatron-hetero profile` argument errors: one line, exit 1, before any measurement."""

from __future__ import annotations

import pytest

from megatron_hetero.cli import main

TINY = ("name: tiny\nnum_layers: 2\nhidden_size: 64\nffn_hidden_size: 176\nnum_attention_heads: 4\n"
        "num_query_groups: 4\nvocab_size: 256\nseq_length: 32\n")


@pytest.mark.parametrize("extra, message", [
    (["--micro-batch-sizes", "1,two"], "--micro-batch-sizes: '1,two'; expected comma-separated integers"),
    (["--micro-batch-sizes", "0"], "--micro-batch-sizes: '0'; expected positive integers"),
    (["--tensor-parallel-sizes", "3"], "--tensor-parallel-sizes: 3 does not divide"),
    (["--repeats", "0"], "--repeats 0"),
    (["--idle-factor", "-1"], "--idle-factor -1.0: expected a finite number >= 0"),
    (["--idle-factor", "inf"], "--idle-factor inf: expected a finite number >= 0"),
    (["--cpu-threads", "0"], "--cpu-threads 0: expected at least 1"),
    (["-o", "."], ": a folder's path; expected a file path"),
])
def test_bad_arguments(tmp_path, capsys, extra, message):
    model = tmp_path / "tiny.yaml"
    model.write_text(TINY)
    out = tmp_path / "p.yaml"
    assert main(["profile", "--model", str(model), "-o", str(out), *extra]) == 1  # last -o wins
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_unknown_model(capsys):
    assert main(["profile", "--model", "llama9-1t"]) == 1
    assert "llama2-7b" in capsys.readouterr().err  # the presets are listed
