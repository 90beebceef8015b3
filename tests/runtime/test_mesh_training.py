"""Mesh plans (format 2) under Megatron-LM's own training loop on megatron-core 0.19.2, through
``python -m megatron_hetero.launch`` on CPU ranks (gloo): Megatron-LM core_v0.19.0's ``pretrain_gpt.py``
(mock data) where its git clone is at hand, else the tests' own ``data/train_tiny.py`` (the same
``megatron.training.pretrain``), with the distributed optimizer (Adam), gradient clipping at 1.0
and ``--ckpt-format torch_dist``.

Megatron initialises weights per pipeline rank, so a plan only shares the one process's weights
through a checkpoint: ``ref`` (one process, 4 layers, 2 micro-batches of 2, global batch 4)
trains steps 1-4 and saves after each; every mesh plan loads ``ref``'s step-1 checkpoint and
trains steps 2-4, each step's loss and gradient norm (whole model) equal to ``ref``'s within
fp32 rtol 1e-5:

* ``tp1-tp2`` (3 ranks): layers 1-2 at TP 1 on an A100, offloading as ``dp2-dp1``'s first
  mesh, layers 3-4 at TP 2 on V100s with full recompute (the bridge broadcasts); the launcher
  starts the V100s first, and each process is placed on its device type's rank;
* ``dp2-dp1`` (3 ranks): 2 replicas of 2 micro-batches of 1, then 1 replica of 2 x 2 (fan-in);
  the first mesh offloads its module inputs (fine-grained activation offloading), the second
  does not (its rank joins megatron-core's offload summary with nothing); no optimizer offload:
  megatron-core runs it in 16 bits only, and ``validate`` refuses it in these fp32 plans (the
  CPU trainer's rehearsals run it, ``tests/emulate``);
* ``tp2dp1-tp1dp2`` (4 ranks): TP 2 x DP 1 then TP 1 x DP 2 (fan-out);
* ``pp2-tp2`` (4 ranks): two stages of one layer at TP 1, then one of two layers at TP 2;
* ``tp2-pp2`` (4 ranks): the reverse (the model's last mesh of two stages);
* ``uneven`` (4 ranks): two meshes of two replicas running 3 and 1 micro-batches of 1
  (per-token loss, the token count summed over every mesh);
* ``plain`` (3 ranks): ``dp2-dp1`` with Adam outside the distributed optimizer (each replica
  holds its mesh's whole gradient: the norm counts it once), against ``ref-plain``, the one
  process without it.

``tp1-tp2`` also saves after steps 2 and 4, and ``resume`` (the same plan) loads its step 2 and
trains steps 3-4 again, writing the same step-4 checkpoint; that checkpoint holds the one
process's step-4 state under the same keys (each layer under its global number). ``from-mesh``
(a format-1 plan of two stages, TP 1) loads that mesh plan's step-2 checkpoint and trains steps
3-4 equal to the one process: a checkpoint crosses from a mesh plan back to a plain one.

Each megatron-core of ``tests.conftest.STACKS`` runs the chain with its own Megatron-LM release
(``launching.megatron_lm_checkout``): 0.19.2, the default, every run above; 0.17.1, the oldest
supported (core_v0.17.1's ``pretrain_gpt.py``), ``ref``, ``tp1-tp2``, ``uneven``, ``resume`` and
``from-mesh`` (:data:`MESH_RUNS`, chosen for CI's time).
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from megatron_hetero.plan import save_any_plan, save_plan

from ..conftest import STACKS
from .launching import launch, name_training_script, training_script
from .plans import A100, V100, make_mesh_plan, make_plan
from .test_checkpoint_resume import CHECKPOINT_ARGS, _assert_same_state, _close, _steps, _tensors

pytestmark = pytest.mark.slow

STEPS = 4
FULL = {"granularity": "full", "method": "uniform", "num_layers": 1}
MESH_PLANS = {  # name: (ranks, [(tp, dp, layers per stage, recompute), ...])
    "tp1-tp2": (3, [(1, 1, [2], None), (2, 1, [2], FULL)]),  # A100 TP 1 -> V100 TP 2
    "dp2-dp1": (3, [(1, 2, [2], None), (1, 1, [2], None)]),
    "tp2dp1-tp1dp2": (4, [(2, 1, [2], None), (1, 2, [2], None)]),
    "pp2-tp2": (4, [(1, 1, [1, 1], None), (2, 1, [2], None)]),
    "tp2-pp2": (4, [(2, 1, [2], None), (1, 1, [1, 1], None)]),
    "uneven": (4, [(1, 2, [2], None), (1, 2, [2], None)]),  # replicas of 3 and 1 micro-batches
    "plain": (3, [(1, 2, [2], None), (1, 1, [2], None)]),  # dp2-dp1, no distributed optimizer
}
# {mesh: offload of its stages}: module inputs only; optimizer offload runs in 16 bits only
# (validate refuses it in fp32), which these fp32 equivalence runs are not
INPUTS = {"module_inputs": True}
OFFLOAD = {"dp2-dp1": {0: INPUTS}, "tp1-tp2": {0: INPUTS}}
PLAIN = {"plain", "ref-plain"}  # Adam without the distributed optimizer (its own reference)
REFERENCE = {"plain": "ref-plain"}
REPLICAS = {"uneven": [(1, 3), (1, 1)]}
DEVICES = {"tp1-tp2": [A100, V100]}
LAUNCHER_TYPES = {run: [V100, V100, A100] for run in ("tp1-tp2", "resume")}  # V100s first
PLACED = {run: [1, 2, 0] for run in ("tp1-tp2", "resume")}  # Megatron rank of each launcher rank
MESH_RUNS = {"0.19": list(MESH_PLANS), "0.17": ["tp1-tp2", "uneven"]}
"""The mesh plans each megatron-core of :data:`tests.conftest.STACKS` trains."""
assert set(MESH_RUNS) == set(STACKS)


def mesh_plan(name: str):
    """The mesh plan ``name`` of :data:`MESH_PLANS` as the chain trains it."""
    return make_mesh_plan(MESH_PLANS[name][1], replicas=REPLICAS.get(name),
                          devices=DEVICES.get(name), distributed_optimizer=name not in PLAIN,
                          offload=OFFLOAD.get(name))


def _cases(runs=None) -> list:
    """``(stack, run)`` of every mesh plan trained under each stack (of ``runs`` only)."""
    return [pytest.param(stack, name, id=f"{stack}-{name}") for stack, names in MESH_RUNS.items()
            for name in names if runs is None or name in runs]


def _runs(root: Path, names: list[str]):
    """(run, plan file, ranks, extra arguments) of the mesh plans ``names`` (``tp1-tp2`` among
    them) and the runs they need, in the order they run."""
    tp = str(root / "ckpt-tp1-tp2")
    runs = [(ref, ref, 1, ["--save", str(root / f"ckpt-{ref}"), "--save-interval", "1"])
            for ref in ("ref", "ref-plain") if ref == "ref" or "plain" in names]
    for name in names:
        ranks = MESH_PLANS[name][0]
        ref = str(root / f"ckpt-{REFERENCE.get(name, 'ref')}")
        extra = ["--load", ref, "--ckpt-step", "1", "--no-load-rng"]  # ref's rng: one grid
        if name == "tp1-tp2":
            extra += ["--save", tp, "--save-interval", "2"]
        runs.append((name, name, ranks, extra))
    runs.append(("resume", "tp1-tp2", 3, ["--load", tp, "--ckpt-step", "2",
                                          "--save", str(root / "ckpt-resume"),
                                          "--save-interval", "2"]))
    # the mesh plan's rng state is keyed per mesh: a plain plan takes the weights and optimizer
    runs.append(("from-mesh", "pp2", 2, ["--load", tp, "--ckpt-step", "2", "--no-load-rng"]))
    return runs


@pytest.fixture
def chains(mesh_chains, request):
    """:func:`mesh_chains`, the script that ran named in the test's output."""
    def chain(stack: str) -> dict:
        done = mesh_chains(stack)
        name_training_script(request, done["what"])
        return done
    return chain


@pytest.fixture(scope="module")
def mesh_chains(tmp_path_factory):
    """``chain(stack)``: the records of :data:`MESH_RUNS` ``[stack]``'s chain, run once."""
    done = {}

    def chain(stack: str) -> dict:
        if stack not in done:
            done[stack] = _chain(tmp_path_factory.mktemp(f"meshes-{stack}"), stack)
        return done[stack]
    return chain


def _chain(root: Path, stack: str) -> dict:
    script, base_args, what = training_script(root, stack)
    for ref in ("ref", "ref-plain"):
        save_plan(make_plan(split=(4,), replicas=[(2, 2)],
                            distributed_optimizer=ref not in PLAIN), root / f"{ref}.yaml")
    save_plan(make_plan(split=(2, 2), replicas=[(2, 2)], distributed_optimizer=True),
              root / "pp2.yaml")
    for name in MESH_PLANS:
        save_any_plan(mesh_plan(name), root / f"{name}.yaml")
    records, walls = {}, {}

    def run_one(run, plan, ranks, extra):
        work = root / run
        work.mkdir()
        start = time.perf_counter()
        results = launch(ranks, str(root / f"{plan}.yaml"), work, script=script,
                         base_args=base_args, iters=STEPS, extra=CHECKPOINT_ARGS + extra,
                         env={"SAMPLES_LOG": str(work / "samples"),
                              # the tiny model's module inputs offloaded (data/recording.py)
                              **({"OFFLOAD_MIN_NUMEL": "1"} if plan in OFFLOAD else {})},
                         timeout=500,
                         launcher_types=LAUNCHER_TYPES.get(run), stack=stack)
        walls[run] = time.perf_counter() - start
        for code, out, _ in results:
            assert code == 0, f"{run}: {out[-3000:]}"
        records[run] = [json.loads((work / f"samples.{r}").read_text()) for r in range(ranks)]

    runs = _runs(root, MESH_RUNS[stack])
    refs = sum(run in ("ref", "ref-plain") for run, *_ in runs)
    # the one-process references side by side (one core each), then the plans in order
    with ThreadPoolExecutor(2) as pool:
        for done in [pool.submit(run_one, *args) for args in runs[:refs]]:
            done.result()
    for args in runs[refs:]:
        run_one(*args)
    print("wall time per run (s):", {k: round(v, 1) for k, v in walls.items()})
    return {"records": records, "root": root, "script": script, "what": what}


def _by_rank(records: list) -> list:
    """Records in Megatron rank order (the launcher's order may differ: ``tp1-tp2``)."""
    return sorted(records, key=lambda rec: rec["rank"])


@pytest.mark.parametrize("stack,name", _cases())
def test_mesh_plan_trains_equal_to_one_process(chains, stack, name):
    """Steps 2-4 of each mesh plan: the loss (on the last mesh) and the gradient norm (the
    whole model's, on every rank) equal the one process's within rtol 1e-5."""
    rec = chains(stack)["records"]
    ref, got = _steps(rec[REFERENCE.get(name, "ref")]), _steps(rec[name])
    assert sorted(ref) == [1, 2, 3, 4] and sorted(got) == [2, 3, 4]
    _close(got, ref)
    ranks, meshes = MESH_PLANS[name]
    t, d, _, _ = meshes[-1]
    last = ranks - t * d  # the first rank of the model's last stage
    records = _by_rank(rec[name])
    assert [r["rank"] for r in records] == list(range(ranks))
    for r, record in enumerate(records):  # the loss only on the last stage; the norm everywhere
        assert [s[0] for s in record["steps"]] == [1, 2, 3]
        assert all((s[1] is not None) == (r >= last) for s in record["steps"]), (name, r)
        assert [s[2] for s in record["steps"]] == [s[2] for s in records[-1]["steps"]]


@pytest.mark.parametrize("stack,run", _cases(["dp2-dp1", "tp1-tp2"]) + [
    pytest.param(stack, "resume", id=f"{stack}-resume") for stack in STACKS])
def test_offload_runs_on_the_offloading_mesh_only(chains, stack, run):
    """``dp2-dp1``, ``tp1-tp2`` and its ``resume``: every rank of the first mesh offloads module
    inputs; the second mesh's ranks do not, and joined megatron-core's offload summary (with
    nothing) rather than hang in it; no rank offloads optimizer state."""
    _, meshes = MESH_PLANS["tp1-tp2" if run == "resume" else run]
    tp, dp, layers, _ = meshes[0]
    first = tp * dp * len(layers)  # the first mesh's ranks
    for r, record in enumerate(_by_rank(chains(stack)["records"][run])):
        got = record["offload"]
        assert "optimizer_host_numel" not in got, got
        if r < first:
            assert sum(got["module_input_bytes"].values()) > 0, got
        else:
            assert got["module_input_bytes"] == {}, got


@pytest.mark.parametrize("stack", list(STACKS))
def test_ranks_placed_by_device_type(chains, stack):
    """``tp1-tp2`` and its ``resume``: the launcher started the two V100s first; each process
    plays the plan's rank of its device type (the A100 mesh's rank 0), and trains equal to one
    process (above); a plan of one device type keeps the launcher's order."""
    records = chains(stack)["records"]
    for run in ("tp1-tp2", "resume", "dp2-dp1", "uneven"):
        if run in records:
            want = PLACED.get(run, list(range(len(records[run]))))
            assert [rec["rank"] for rec in records[run]] == want, run


@pytest.mark.parametrize("stack,name", _cases())
def test_first_mesh_reads_every_sample_once(chains, stack, name):
    """The first mesh's replicas (their tensor rank 0) read, in each step, exactly the samples
    the one process read in that step (each replica its share)."""
    rec = chains(stack)["records"]
    _, meshes = MESH_PLANS[name]
    tp, dp = meshes[0][0], meshes[0][1]
    want = {}
    for it, idx in rec["ref"][0]["read"]:
        want.setdefault(it, []).append(idx)
    got = {}
    for replica in range(dp):
        record = _by_rank(rec[name])[replica * tp]  # mesh 0, stage 0, this replica, tensor rank 0
        assert record["dp"] == replica and record["tp"] == 0
        for it, idx in record["read"]:
            got.setdefault(it, []).append(idx)
    assert sorted(got) == [1, 2, 3]
    for it, idx in got.items():
        assert sorted(idx) == sorted(want[it]), it


@pytest.mark.parametrize("stack", list(STACKS))
def test_same_mesh_plan_resume_equals_the_uninterrupted_job(chains, stack, tmp_path):
    """``tp1-tp2`` resumed from its own step-2 checkpoint trains steps 3-4 as before and writes
    the same step-4 checkpoint (weights and the distributed optimizer's Adam state)."""
    chain = chains(stack)
    rec = chain["records"]
    full, resumed = _steps(rec["tp1-tp2"]), _steps(rec["resume"])
    assert sorted(resumed) == [3, 4]
    _close(resumed, full)
    root = chain["root"]
    a = _tensors(root / "ckpt-tp1-tp2" / "iter_0000004", tmp_path, stack)
    b = _tensors(root / "ckpt-resume" / "iter_0000004", tmp_path, stack)
    assert a.keys() == b.keys()
    assert any(k.startswith("/optimizer.state.exp_avg_sq.") for k in a)
    _assert_same_state(a, b, keys=a)


@pytest.mark.parametrize("stack", list(STACKS))
def test_a_plain_plan_resumes_a_mesh_plans_checkpoint(chains, stack):
    """A format-1 plan (two stages, TP 1, the distributed optimizer) loads ``tp1-tp2``'s step-2
    checkpoint (layers 3-4 saved from two tensor ranks) and trains steps 3-4 equal to the one
    process: Megatron's resharding carries the weights and the Adam state out of a mesh plan."""
    rec = chains(stack)["records"]
    got = _steps(rec["from-mesh"])
    assert sorted(got) == [3, 4]
    _close(got, _steps(rec["ref"]))


@pytest.mark.parametrize("stack", list(STACKS))
def test_mesh_checkpoint_holds_the_one_process_state(chains, stack, tmp_path):
    """The step-4 checkpoint written under ``tp1-tp2`` (layers 1-2 whole on one rank, layers 3-4
    split over two tensor ranks) holds the one process's step-4 state under the same keys: the
    stacked layers whole, the optimizer state too."""
    root = chains(stack)["root"]
    mesh = _tensors(root / "ckpt-tp1-tp2" / "iter_0000004", tmp_path, stack)
    ref = _tensors(root / "ckpt-ref" / "iter_0000004", tmp_path, stack)
    layers = [k for k in ref if k.startswith("/decoder.layers.")]
    assert layers and all(ref[k].shape[0] == 4 for k in layers)
    assert set(layers) <= set(mesh)
    common = [k for k in ref if k in mesh]
    assert any(k.startswith("/optimizer.state.exp_avg.decoder.layers.") for k in common)
    _assert_same_state(mesh, ref, keys=common)


@pytest.mark.parametrize("stack", list(STACKS))
def test_the_checkpoint_reader_reads_the_mesh_checkpoint(chains, stack):
    """``replan``'s reader (no torch) reads the step-4 save of ``tp1-tp2``: its iteration, the
    arguments it was trained with and every stacked layer's whole shape (megatron-core 0.19
    keeps the arguments in the ``*.distcp`` files, not in ``common.pt``)."""
    from megatron_hetero.launch.checkpoint import read_checkpoint

    ckpt = read_checkpoint(chains(stack)["root"] / "ckpt-tp1-tp2")
    assert ckpt.iteration == 4 and ckpt.format == "torch_dist"
    assert ckpt.arg("num_layers") == 4 and ckpt.arg("train_iters") == STEPS
    layers = {k: t.shape for k, t in ckpt.tensors.items() if k.startswith("decoder.layers.")}
    assert layers and all(shape[0] == 4 for shape in layers.values())
