"""Fuzzing every loader (issue 18 item 6): plans (format 1 and mesh plans), inventories, model
files and profiles, fed random documents and random mutations of valid ones. Each must give a
loaded object or our one-line error (:class:`HeteroError`), never another exception, and in
bounded time (hypothesis' deadline per example).

Runs are derandomized with a fixed number of examples, so CI sees the same inputs every time.
The cases the fuzzer found are named in ``NAMED`` and loaded one by one as well.
"""

from __future__ import annotations

import datetime
import functools
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_hetero._schema import to_data
from megatron_hetero.cost.profile_file import load_profile, save_profile
from megatron_hetero.errors import HeteroError
from megatron_hetero.hardware.catalog import load_catalog
from megatron_hetero.hardware.inventory import load_inventory
from megatron_hetero.launch.jobspec import read_hostfile
from megatron_hetero.models import PRESETS, load_model
from megatron_hetero.plan import load_any_plan

from .test_profile_file import _profile

REPO = Path(__file__).resolve().parents[1]
_DIR = Path(tempfile.mkdtemp(prefix="fuzz-loaders-"))


def _model_file() -> Path:
    path = _DIR / "seed-model.yaml"
    path.write_text(yaml.safe_dump(to_data(PRESETS["llama3-8b"]), sort_keys=False))
    return path


def _hostfile() -> Path:
    path = _DIR / "seed-hosts.txt"
    path.write_text("# slurm nodes\nnode01 A100-SXM-80GB 8\nnode02 a100-sxm-80gb 8  # any case\n"
                    "node03 V100-SXM2-32GB\n")
    return path


def _profile_file() -> Path:
    path = _DIR / "seed-profile.yaml"
    save_profile(_profile(), path)
    return path


LOADERS = {
    "plan": (load_any_plan, lambda: [REPO / "tests/data/plan_a100_v100.yaml",
                                     REPO / "examples/llama2/70b/plan.yaml",
                                     REPO / "examples/meshes/3090-t4-plan.yaml"]),
    "inventory": (load_inventory, lambda: [REPO / "examples/llama2/13b/inventory.yaml",
                                           REPO / "examples/meshes/inventory.yaml",
                                           REPO / "examples/llama2/7b/inventory.yaml"]),
    "model": (lambda p: load_model(str(p)), lambda: [_model_file()]),
    "profile": (lambda p: load_profile(p, catalog=load_catalog()), lambda: [_profile_file()]),
    "hostfile": (lambda p: read_hostfile(p, load_catalog(), default_gpus=4),
                 lambda: [_hostfile()]),
}
YAML_KINDS = sorted(set(LOADERS) - {"hostfile"})


@functools.cache
def _seeds(kind: str) -> tuple[str, ...]:
    return tuple(p.read_text() for p in LOADERS[kind][1]())


def _load(kind: str, content: bytes | str) -> None:
    """Load ``content`` with loader ``kind``: a loaded object or a HeteroError, nothing else."""
    path = _DIR / f"{kind}.yaml"
    if isinstance(content, str):
        content = content.encode("utf-8", "surrogatepass")
    path.write_bytes(content)
    try:
        LOADERS[kind][0](path)
    except HeteroError as exc:
        assert "\n" not in str(exc), f"not one line: {exc}"


FUZZ = settings(max_examples=40, derandomize=True, deadline=datetime.timedelta(seconds=5),
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
kinds = st.sampled_from(sorted(LOADERS))

# Values that break the assumptions of a schema: out-of-range, non-finite, wrong type, odd text.
nasty = st.one_of(
    st.sampled_from([0, -1, 1, 2**63, -(2**63) - 1, 10**30, 10**400, 1e308, 1e-320,
                     float("nan"), float("inf"), -float("inf"), "", "x\ny", "é", "\x00",
                     None, True, [], {}, [1, [2]], {"a": {"b": None}}, "1e5", ".inf",
                     "a" * 10_000, 2**31, 999_999_999_999]),
    st.integers(), st.floats(), st.text(max_size=20), st.booleans(),
)
plain = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=10)),
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=20)


def _paths(data, prefix=()):
    yield prefix
    if isinstance(data, dict):
        for k, v in data.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            yield from _paths(v, prefix + (i,))


def _mutate(data, path, op, value):
    """``data`` with the node at ``path`` replaced, removed, duplicated or given a new key."""
    if not path:
        return value if op == "replace" else data
    parent = data
    for k in path[:-1]:
        parent = parent[k]
    key = path[-1]
    if op == "replace":
        parent[key] = value
    elif op == "delete":
        del parent[key]
    elif op == "wrap":
        parent[key] = [parent[key]]
    elif op == "unknown" and isinstance(parent, dict):
        parent[f"{key}_x"] = value
    elif op == "unknown":
        parent.append(value)
    return data


@st.composite
def mutated_data(draw, kind):
    if kind == "hostfile":
        return draw(mutated_text(kind))
    seed = yaml.safe_load(draw(st.sampled_from(_seeds(kind))))
    for _ in range(draw(st.integers(1, 3))):
        paths = list(_paths(seed))
        path = draw(st.sampled_from(paths))
        op = draw(st.sampled_from(["replace", "replace", "delete", "wrap", "unknown"]))
        seed = _mutate(seed, path, op, draw(nasty))
    return yaml.safe_dump(seed, sort_keys=False, allow_unicode=draw(st.booleans()))


YAML_BITS = ["&a ", "*a", "<<: *a\n", "!!python/object:os.system ", "!!binary ", "!!set ",
             "!!timestamp ", "!!int ", "!!float ", "!!str ", "!!omap ", "!!pairs ", "? ", ": ",
             "\t", "- ", "{", "}", "[", "]", ",", "\n", "'", '"', "#", "%YAML 1.1\n", "---\n",
             "...\n", "|\n", ">\n", "\\", "0x", "0o", "0b", "1_000", "2001-12-14", ".nan",
             "~", "\ufeff", "\x85", "\u2028", "9" * 30, "-", "=", "!", "&", "*", "@", "`"]


@st.composite
def mutated_text(draw, kind):
    text = draw(st.sampled_from(_seeds(kind)))
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(text)))
        op = draw(st.sampled_from(["insert", "delete", "dup-line", "bytes"]))
        if op == "insert":
            bit = draw(st.one_of(st.sampled_from(YAML_BITS), st.text(max_size=5)))
            text = text[:i] + bit + text[i:]
        elif op == "delete":
            text = text[:i] + text[i + draw(st.integers(1, 40)):]
        elif op == "dup-line":
            lines = text.splitlines(keepends=True)
            j = draw(st.integers(0, max(len(lines) - 1, 0)))
            text = "".join(lines[:j + 1] + lines[j:])
        else:
            return text[:i].encode() + draw(st.binary(min_size=1, max_size=8)) + text[i:].encode()
    return text


@FUZZ
@given(kinds, st.binary(max_size=200))
def test_random_bytes(kind, raw):
    _load(kind, raw)


@FUZZ
@given(kinds, st.lists(st.sampled_from(YAML_BITS + list("abc:01 \n")), max_size=30))
def test_random_yaml_text(kind, bits):
    _load(kind, "".join(bits))


@FUZZ
@given(kinds, plain)
def test_random_documents(kind, data):
    _load(kind, yaml.safe_dump(data))


@settings(FUZZ, max_examples=120)
@given(st.data())
def test_mutations_of_valid_documents(data):
    kind = data.draw(kinds)
    _load(kind, data.draw(mutated_data(kind)))


@settings(FUZZ, max_examples=120)
@given(st.data())
def test_text_mutations_of_valid_files(data):
    kind = data.draw(kinds)
    _load(kind, data.draw(mutated_text(kind)))


HOSTFILES = {
    # a traceback each: found by the fuzzer
    "a byte that is not UTF-8": (b"node01 A100-SXM-80GB 8\n\xff\n", "byte 23"),
    # ... and by reading the loader
    "a superscript digit, which str.isdigit accepts": ("node01 A100-SXM-80GB \u00b2\n".encode(),
                                                       "expected a positive integer"),
}


@pytest.mark.parametrize("case", sorted(HOSTFILES))
def test_named_bad_hostfiles(case):
    raw, words = HOSTFILES[case]
    path = _DIR / "named-hosts.txt"
    path.write_bytes(raw)
    with pytest.raises(HeteroError) as got:
        LOADERS["hostfile"][0](path)
    assert str(path) in str(got.value) and words in str(got.value)


def test_the_seeds_load():
    for kind, (load, paths) in LOADERS.items():
        for path in paths():
            assert load(path) is not None


def _bomb(levels: int = 9) -> str:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]")
    return "\n".join(lines) + "\n"


NAMED = {
    # found by the fuzzer: PyYAML's constructors raise ValueError, IndexError, AttributeError
    "!!int with no digits": ("a: !!int\n", "line 1, column 4"),
    "!!int of a sign alone": ("a: !!int --\n", "cannot be read as !!int"),
    "!!float with no digits": ("a: !!float\n", "cannot be read as !!float"),
    "!!timestamp of a word": ("a: !!timestamp x\n", "cannot be read as !!timestamp"),
    "an integer of 5000 digits": ("a: " + "9" * 5000 + "\n", "cannot be read as !!int"),
    "!!set on a scalar": ("a: !!set \\\n", "expected a mapping node, but found scalar"),
    # a few lines that expand to 9^9 values through aliases (minutes and gigabytes before)
    "alias bomb": (_bomb(), "more than 1,000,000 values"),
    "an alias inside its own anchor": ("&a [*a]\n", "contains itself"),
    # a key with a line break stays on one line, quoted
    "key with a line break": ('"gr\\noups": []\n', "'gr\\noups'"),
    "key with a tab": ('"\\tname": x\n', "'\\tname'"),
}


@pytest.mark.parametrize("kind", YAML_KINDS)
@pytest.mark.parametrize("case", sorted(NAMED))
def test_named_bad_documents(kind, case):
    text, words = NAMED[case]
    path = _DIR / f"named-{kind}.yaml"
    path.write_text(text)
    with pytest.raises(HeteroError) as got:
        LOADERS[kind][0](path)
    assert str(path) in str(got.value) and words in str(got.value)
    assert "\n" not in str(got.value)
