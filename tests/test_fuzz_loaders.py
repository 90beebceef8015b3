"""Fuzzing every loader (issue 18 item 6): plans (format 1 and mesh plans), inventories, model
files and profiles, fed random documents and random mutations of valid ones. Each must give a
loaded object or our one-line error (:class:`HeteroError`), never another exception, and in
bounded time (hypothesis' deadline per example).

An accepted file must be a valid one (issue 32 B): every invariant a loader promises holds on
what it returned (each figure within its quantity's bounds, the layers adding up, the GPUs
counted) and it round-trips: written back and read again, it is the same object. Every output
path kind (``Outputs``) is fuzzed too: random names, folders, links, loops, streams and inputs,
each refused with one line before anything is written, or written whole with no other file of
the folder changed.

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

import dataclasses
import os

from megatron_hetero._schema import to_data
from megatron_hetero.hardware.inventory import inventory_from_data
from megatron_hetero.launch.checkpoint import SAVED_ARGS, read_checkpoint
from megatron_hetero.limits import QUANTITIES
from megatron_hetero.outputs import Outputs
from megatron_hetero.plan import save_any_plan
from megatron_hetero.cost.profile_file import load_profile, save_profile
from megatron_hetero.errors import HeteroError
from megatron_hetero.hardware.catalog import load_catalog
from megatron_hetero.hardware.inventory import load_inventory
from megatron_hetero.launch.jobspec import read_hostfile
from megatron_hetero.models import PRESETS, load_model
from megatron_hetero.plan import load_any_plan

from .fake_checkpoint import ARGS, write_checkpoint
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


def _load(kind: str, content: bytes | str) -> bool:
    """Load ``content`` with loader ``kind``: a valid object (:func:`_check_valid`; True) or a
    HeteroError of one line (False), nothing else."""
    path = _DIR / f"{kind}.yaml"
    if isinstance(content, str):
        content = content.encode("utf-8", "surrogatepass")
    path.write_bytes(content)
    try:
        loaded = LOADERS[kind][0](path)
    except HeteroError as exc:
        assert "\n" not in str(exc), f"not one line: {exc}"
        return False
    _check_valid(kind, loaded)
    return True


def _quantities_in_bounds(obj, where: str = "") -> None:
    """Every field of the dataclass tree ``obj`` declared as a quantity is within its bounds."""
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _quantities_in_bounds(v, f"{where}[{i}]")
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _quantities_in_bounds(v, f"{where}.{k}")
    elif dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            kind = f.metadata.get("quantity")
            if kind and value is not None:
                low, high, _ = QUANTITIES[kind]
                assert low <= value <= high, f"{where}.{f.name} = {value!r} accepted"
            _quantities_in_bounds(value, f"{where}.{f.name}")


def _check_valid(kind: str, loaded) -> None:
    """``loaded`` keeps its loader's invariants and round-trips through its writer."""
    again = _DIR / f"{kind}-again.yaml"
    if kind == "plan":
        _quantities_in_bounds(loaded.gpus)
        assert sum(loaded.layer_split) == loaded.model.num_layers
        assert loaded.world_size == sum(loaded.device_counts().values()) > 0
        save_any_plan(loaded, again)
        assert LOADERS["plan"][0](again).to_data() == loaded.to_data()
    elif kind == "inventory":
        _quantities_in_bounds(loaded)
        assert loaded.num_gpus == sum(g.nodes * g.gpus_per_node for g in loaded.groups) > 0
        assert all(g.gpu in loaded.catalog.names() for g in loaded.groups)
        for name in loaded.gpus:
            _quantities_in_bounds(loaded.catalog.get(name))
        data = to_data(loaded)
        assert to_data(inventory_from_data(data, source=str(again))) == data
    elif kind == "model":
        assert loaded.num_query_groups >= 1 and loaded.num_attention_heads >= 1
        again.write_text(yaml.safe_dump(to_data(loaded), sort_keys=False))
        assert load_model(str(again)) == loaded
    elif kind == "profile":
        _quantities_in_bounds(loaded.data)
        assert loaded.data.entries
        save_profile(loaded.data, again)
        assert LOADERS["profile"][0](again).data.to_data() == loaded.data.to_data()
    else:  # hostfile
        hosts = [e.host for e in loaded]
        assert len(set(hosts)) == len(hosts) and all(e.num_gpus >= 1 for e in loaded)
        again.write_text("".join(f"{e.host} {e.device_type} {e.num_gpus}\n" for e in loaded))
        assert LOADERS["hostfile"][0](again) == loaded


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


def _at(data, path):
    for k in path:
        data = data[k]
    return data


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _nearby(value):
    """Numbers a file could plausibly hold instead of ``value``: within a factor of 2, or 0 and
    1 (mutations that loaders often accept, so that what they accept gets checked)."""
    if isinstance(value, int):
        return st.one_of(st.integers(max(value // 2, 0), max(value * 2, 2)), st.just(value + 1))
    return st.floats(value / 2, value * 2) if value > 0 else st.sampled_from([0.0, 1.0])


@st.composite
def mutated_data(draw, kind):
    if kind == "hostfile":
        return draw(mutated_text(kind))
    seed = yaml.safe_load(draw(st.sampled_from(_seeds(kind))))
    for _ in range(draw(st.integers(1, 3))):
        paths = list(_paths(seed))
        op = draw(st.sampled_from(["replace", "replace", "delete", "wrap", "unknown", "nudge",
                                   "nudge"]))
        numbers = [p for p in paths if _is_number(_at(seed, p))]
        if op == "nudge" and numbers:  # a plausible figure in place of another
            path = draw(st.sampled_from(numbers))
            seed = _mutate(seed, path, "replace", draw(_nearby(_at(seed, path))))
            continue
        path = draw(st.sampled_from(paths))
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


def _mutations(mutated, counts: dict) -> None:
    """About 120 examples of ``mutated`` (a strategy of a kind's documents), the same number of
    each kind; ``counts[kind]``: how many each kind's loader refused and accepted (and
    :func:`_check_valid` found valid)."""
    def examples(kind):
        @settings(FUZZ, max_examples=120 // len(LOADERS) + 10)
        @given(st.data())
        def run(data):
            accepted = _load(kind, data.draw(mutated(kind)))
            counts.setdefault(kind, [0, 0])[accepted] += 1
        return run

    for kind in sorted(LOADERS):  # every kind its share of the examples, whatever the draws
        examples(kind)()


def test_mutations_of_valid_documents():
    """Mutated documents give one line or a valid object, and the validity check is reached:
    of each kind some mutations are accepted (a fuzz that only ever saw refusals could not
    catch a loader that accepts a wrong file)."""
    counts = {}
    _mutations(mutated_data, counts)
    assert all(counts.get(kind, [0, 0])[True] > 0 for kind in LOADERS), counts


def test_text_mutations_of_valid_files():
    counts = {}
    _mutations(mutated_text, counts)
    assert all(counts.get(kind, [0, 0])[True] > 0 for kind in LOADERS), counts


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
            loaded = load(path)
            assert loaded is not None
            _check_valid(kind, loaded)


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


# -- every output path -------------------------------------------------------------------------

def _folder() -> Path:
    """A fresh folder with an input file, an input folder (a checkpoint's) with a file in it, an
    existing output, links to it (symbolic, hard), a symlink loop, a dangling link, a folder."""
    d = Path(tempfile.mkdtemp(dir=_DIR, prefix="out-"))
    (d / "in.yaml").write_text("input")
    (d / "ck").mkdir()
    (d / "ck" / "tracker.txt").write_text("2")
    (d / "old.yaml").write_text("old")
    (d / "adir").mkdir()
    os.symlink("old.yaml", d / "link.yaml")
    os.link(d / "in.yaml", d / "hard.yaml")
    os.symlink("l2", d / "l1")
    os.symlink("l1", d / "l2")
    os.symlink("nowhere/x.yaml", d / "dangling.yaml")
    return d


def _snapshot(d: Path) -> dict[str, str]:
    out = {}
    for root, dirs, files in os.walk(d):
        for name in dirs + files:
            p = Path(root) / name
            rel = str(p.relative_to(d))
            out[rel] = ("link:" + os.readlink(p) if p.is_symlink() else "dir" if p.is_dir()
                        else "file:" + p.read_text(errors="replace"))
    return out


OUT_NAMES = ["new.yaml", "old.yaml", "link.yaml", "hard.yaml", "in.yaml", "l1", "dangling.yaml",
             "adir", "adir/", "adir/new.png", "ck/new.yaml", "ck/tracker.txt", "ck", "newdir/",
             "nodir/new.yaml", "in.yaml/x", "", " ", ".", "..", "./new.yaml", "/dev/null",
             "new.tar.gz", ".hidden"]
out_names = st.one_of(
    st.sampled_from(OUT_NAMES),
    st.builds(lambda n, ext: "p" * n + ext, st.integers(240, 270), st.sampled_from(["", ".yaml"])),
    st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00/"),
            min_size=1, max_size=12))


@settings(FUZZ, max_examples=60)
@given(st.lists(out_names, min_size=1, max_size=3), st.booleans())
def test_every_output_path(names, fail):
    """Outputs refuses with one line and nothing changed, or writes every output whole and
    changes no other file; a command that fails changes nothing."""
    d = _folder()
    before = _snapshot(d)
    targets = {f"--out{i}": (str(d / n) if n not in ("", " ") and not n.startswith("/") else n)
               for i, n in enumerate(names)}
    try:
        out = Outputs("fuzz", inputs={"IN": str(d / "in.yaml"), "CK": str(d / "ck")},
                      outputs=targets)
    except HeteroError as exc:
        assert "\n" not in str(exc) and str(exc), exc
        assert _snapshot(d) == before
        return
    written = {}
    try:
        with out:
            for name, target in targets.items():
                if target:
                    out.staged(target).write_text(f"new {name}")
                    written[os.path.realpath(target)] = f"new {name}"
            if fail:
                raise HeteroError("the command failed")
    except HeteroError:
        assert fail
        assert _snapshot(d) == before
        return
    after = _snapshot(d)
    assert not [k for k in after if ".partial-" in k], after
    assert after["in.yaml"] == before["in.yaml"] and after["ck/tracker.txt"] == before["ck/tracker.txt"]
    for real, text in written.items():
        if real != "/dev/null":
            assert Path(real).read_text() == text
    changed = {k for k in set(before) | set(after) if before.get(k) != after.get(k)}
    reals = {os.path.realpath(d / k) for k in changed}
    assert reals <= set(written), (changed, written)


# -- checkpoints (read without torch) -------------------------------------------------------

@settings(FUZZ, max_examples=25)
@given(st.dictionaries(st.sampled_from(sorted(ARGS) + ["hetero_plan"]), nasty, max_size=3),
       st.one_of(st.none(), st.text(max_size=8), st.sampled_from(["release", "2", "0002", "9" * 30])),
       st.one_of(st.none(), st.binary(max_size=30), st.sampled_from([b"[]", b"null", b"{}"])),
       st.one_of(st.none(), nasty))
def test_damaged_checkpoints(args, tracker, metadata, sharding):
    """A checkpoint with saved arguments, tracker, metadata.json or sharding type replaced:
    a Checkpoint whose typed arguments hold and whose model is one line or valid, or one
    line naming the file."""
    folder = Path(tempfile.mkdtemp(dir=_DIR, prefix="ck-")) / "ck"
    write_checkpoint(folder, args={**ARGS, **args},
                     content_metadata=None if sharding is None else {"distrib_optim_sharding_type": sharding})
    if tracker is not None:
        (folder / "latest_checkpointed_iteration.txt").write_text(tracker, errors="surrogatepass")
    if metadata is not None:
        (folder / "iter_0000002" / "metadata.json").write_bytes(metadata)
    try:
        ckpt = read_checkpoint(folder)
    except HeteroError as exc:
        assert "\n" not in str(exc) and str(folder) in str(exc), exc
        return
    if ckpt.format != "torch_dist":
        return
    for name, (kind, required) in SAVED_ARGS.items():
        value = ckpt.args.get(name)
        assert value is not None or not required, name
    try:
        model = ckpt.model("fuzz")
    except HeteroError as exc:
        assert "\n" not in str(exc) and "common.pt" in str(exc), exc
        return
    assert model.num_layers == ckpt.args["num_layers"] and ckpt.padded_vocab_size(2) % 2 == 0
