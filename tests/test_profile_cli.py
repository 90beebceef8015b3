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


def test_profile_hidden_size_says_what_else_it_shrinks(capsys):
    """Issue 32 A.11: --hidden-size also shrinks the sequence and the vocabulary; it says so."""
    from megatron_hetero.profiler.cli import resolve_model, shrink_note

    full = resolve_model("llama2-7b")
    small = resolve_model("llama2-7b", hidden_size=256)
    note = shrink_note(full, small)
    assert note.startswith("profile: llama2-7b shrunk as the rehearsal shrinks it: hidden 4096 "
                           "-> 256, FFN 11008 -> 688, ")  # 32 heads of 8 stay
    assert f"vocabulary 32000 -> {small.vocab_size}" in note
    assert f"sequence 4096 -> {small.seq_length}" in note
    kept = resolve_model("llama2-7b", hidden_size=256, seq_length=4096)
    assert "sequence 4096 ->" not in shrink_note(full, kept)
    assert shrink_note(full, full) is None
    with pytest.raises(SystemExit):
        main(["profile", "--help"])
    assert "vocabulary and sequence keep their ratio" in " ".join(capsys.readouterr().out.split())
