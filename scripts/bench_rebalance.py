#!/usr/bin/env python3
"""Live rebalancing against a stage that turns 2.5x slower, side by side in one run.

Two modes; ``--mode rehearsal`` (the default) is the issue's benchmark, ``--mode megatron``
the same on Megatron-LM's own loop.

``--mode rehearsal``: the rehearsal (``megatron-hetero rehearse``'s CPU trainer, 4 ranks
playing PP=2 x DP=2, 6 + 6 micro-batches; replica 1's first stage is an A100-SXM-40GB, the
other three A100-SXM-80GB, as fast in the catalog) with ``--slow 'pipelines[1].stages[0]=2.5@S'``:

1. *kept*: the slowdown, shares kept;
2. *rebalanced*: the same with ``--rebalance`` (the runtime's policy and defaults: a drift
   beyond 1.15x on 2 reports in a row), alternated with *kept* ``--repeats`` times (the
   machine's load moves between runs);
3. a rehearsal slowed from the start writes its telemetry (``--telemetry DIR``); from it
   *re-split*: the same PP=2 x DP=2 with the tuner's split (``schedule.shares.water_fill``) of
   the replicas' measured costs, predicted by ``simulate --profile`` on the run's profiles
   (the slowed card is the only A100-SXM-40GB, so its profile is its own), and *re-tuned*:
   ``tune INVENTORY --from-run DIR`` on the pool (3x A100-SXM-80GB + 1x A100-SXM-40GB), its
   own prediction; each also rehearsed under the same slowdown.

Printed side by side: the median step before the slowdown, after it with the shares kept,
after rebalancing (every step from the first that runs new shares), the re-split and re-tuned
plans' predicted and rehearsed steps, and the steps from the slowdown to the first step on new
shares. Every run shares one calibration and one time scale; the load average is printed before
each run.

    .venv/bin/python scripts/bench_rebalance.py [--steps 14] [--slow-from 6]

``--mode megatron``: Megatron's own training loop (the venv's megatron-core 0.19.2 and its
``megatron.training``; the tests' tiny GPT) on 4 CPU ranks: PP=2 x DP=2, each replica 6
micro-batches. Four runs:

1. *even*: no slowdown; its telemetry gives each stage's compute per micro-batch ``c``;
2. *slow*: from iteration ``--slow-from`` the rank of stage 0 of replica 1 sleeps ``1.5 c`` in
   every forward, so that stage computes 2.5x as long; telemetry on, no rebalancing;
3. *rebalanced*: the same slowdown, with ``--hetero-rebalance`` (a report every step,
   patience 1);
4. *re-split*: the same slowdown on a plan whose shares are, from the start, the best split of
   the slowed run's measured costs (the shares a re-tuning for the slowed card gives).

Printed side by side: the median step before the slowdown, after it without rebalancing, and
after the shares moved; the step at which they moved (counted from the slowdown); and the
target, the step the best split of the micro-batches gives as the slowed run's own measured
costs price it (each replica's 1F1B time, :func:`megatron_hetero.telemetry.rebalance.
replica_costs`). The layers are not re-tuned: one replica's stage slowed, and a profile per
device type cannot tell the two replicas' cards apart.

    .venv/bin/python scripts/bench_rebalance.py --mode megatron [--iters 16] [--slow-from 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_hetero.cli import main as cli_main  # noqa: E402
from megatron_hetero.emulate.rehearse import RehearsalConfig, rehearse  # noqa: E402
from megatron_hetero.emulate.slow import parse_slow  # noqa: E402
from megatron_hetero.plan import Slot, load_any_plan, plan_from_data, save_plan  # noqa: E402
from megatron_hetero.telemetry.prediction import stage_path  # noqa: E402
from megatron_hetero.telemetry.rebalance import RebalancePolicy, with_shares  # noqa: E402
from megatron_hetero.schedule.shares import water_fill  # noqa: E402
from megatron_hetero.telemetry.rebalance import replica_costs  # noqa: E402
from megatron_hetero.telemetry.records import read_records  # noqa: E402
from tests.runtime.launching import launch  # noqa: E402
from tests.runtime.plans import make_plan  # noqa: E402


def _run(path, work: Path, *, iters: int, env=None, extra=()):
    work.mkdir()
    tel = work / "telemetry"
    results = launch(4, str(path), work, iters=iters, timeout=900, env=env,
                     extra=["--hetero-telemetry", str(tel), "--hetero-telemetry-interval", "1",
                            "--calculate-per-token-loss", *extra])
    for code, out, _ in results:
        if code != 0:
            sys.exit(out[-3000:])
    return read_records(tel)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--mode", choices=("rehearsal", "megatron"), default="rehearsal")
    parser.add_argument("--iters", type=int, default=16, help="megatron mode: iterations")
    parser.add_argument("--steps", type=int, default=14, help="rehearsal mode: steps")
    parser.add_argument("--time-scale", type=float, default=None,
                        help="rehearsal mode: rehearse --time-scale (default: the rehearsal's "
                             "own); more keeps the emulation ahead of other load")
    parser.add_argument("--nice", type=int, default=0,
                        help="rehearsal mode: rehearse --nice (negative, as root, shields the "
                             "emulated timing from other load)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="rehearsal mode: runs with and without rebalancing, alternated")
    parser.add_argument("--slow-from", type=int, default=None,
                        help="the step the slowdown starts (default: 6 in the rehearsal, "
                             "iteration 4 in Megatron's loop)")
    parser.add_argument("--hidden", type=int, default=None,
                        help="hidden size (default: 32 in the rehearsal, 64 in Megatron's loop)")
    opts = parser.parse_args()
    print(f"load before: {_load()}", flush=True)
    code = _rehearsal(opts) if opts.mode == "rehearsal" else _megatron(opts)
    print(f"load after: {_load()}", flush=True)
    return code


def _load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.1f}, {five:.1f}, {fifteen:.1f} on {os.cpu_count()} cores"


SLOW_CARD, CARD = "A100-SXM-40GB", "A100-SXM-80GB"


def _rehearsal(opts) -> int:
    slow_from, hidden, steps = opts.slow_from or 6, opts.hidden or 32, opts.steps
    model = {"name": "tiny", "num_layers": 4, "hidden_size": 256, "ffn_hidden_size": 688,
             "num_attention_heads": 8, "num_query_groups": 8, "vocab_size": 1000,
             "seq_length": 128}

    plan = plan_from_data({
        "format_version": 1, "model": model, "global_batch_size": 12, "precision": "fp16",
        "tensor_model_parallel_size": 1,
        "pipelines": [{"micro_batch_size": 1, "num_microbatches": 6, "stages": [
            {"device_type": first, "num_layers": 2}, {"device_type": CARD, "num_layers": 2}]}
            for first in (CARD, SLOW_CARD)]})
    slow_path = "pipelines[1].stages[0]"
    state: dict = {}

    def run(label, the_plan, path, first, n, **kw):
        print(f"[bench] {label} ({_load()})", file=sys.stderr, flush=True)
        config = RehearsalConfig(steps=n, hidden_size=hidden,
                                 time_scale=state.get("scale", opts.time_scale), nice=opts.nice,
                                 slow=[parse_slow(f"{path}=2.5@{first}", the_plan, steps=n)],
                                 **kw)
        result = rehearse(the_plan, config, calibration=state.get("calibration"))
        state.setdefault("calibration", result.calibration)
        state.setdefault("scale", result.time_scale)
        return result

    def slow_path_of(the_plan):
        slot = next(the_plan.slot_of_rank(r) for r in range(the_plan.world_size)
                    if the_plan.device_type_of_rank(r) == SLOW_CARD)
        if the_plan.one_grid:
            return stage_path(the_plan, mesh=slot.mesh, stage=slot.stage, replica=slot.replica)
        return f"meshes[{slot.mesh}].replicas[{slot.replica}].stages[{slot.stage}]"

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        kept, moved = [], []
        for rep in range(opts.repeats):  # alternated: the machine's load moves between runs
            kept.append(run(f"shares kept, run {rep}", plan, slow_path, slow_from, steps))
            moved.append(run(f"rebalanced, run {rep}", plan, slow_path, slow_from, steps,
                             rebalance=RebalancePolicy()))
        run("slowed from the start, for tune --from-run", plan, slow_path, 1, 6,
            telemetry=tmp / "measured")
        inventory = tmp / "inventory.yaml"
        inventory.write_text(f"groups:\n  - {{gpu: {CARD}, nodes: 1, gpus_per_node: 3}}\n"
                             f"  - {{gpu: {SLOW_CARD}, nodes: 1, gpus_per_node: 1}}\n")
        profiles = sorted(str(p) for p in (tmp / "measured").glob("profile.*.yaml"))
        retuned_path = tmp / "retuned.yaml"
        if cli_main(["tune", str(inventory), "--from-run", str(tmp / "measured"), "-q",
                     "--micro-batch-sizes", "1", "--tensor-parallel-sizes", "1",
                     "-o", str(retuned_path)]) != 0:
            return 1
        retuned = load_any_plan(str(retuned_path))
        # the same PP=2 x DP=2 (the shrunk plan that ran), its shares the tuner's split of the
        # measured costs
        records = read_records(tmp / "measured")
        costs = [tuple(statistics.median(replica_costs(r)[d][i] for r in records)
                       for i in (0, 1)) for d in range(2)]
        split = water_fill([a for a, _ in costs], [c for _, c in costs], 12)
        resplit = with_shares(load_any_plan(str(tmp / "measured" / "plan.yaml")), split,
                              source="re-split")
        resplit_path = tmp / "resplit.yaml"
        save_plan(resplit, resplit_path)
        sim_json = tmp / "resplit.json"
        if cli_main(["simulate", str(resplit_path), "--inventory", str(inventory),
                     *[a for p in profiles for a in ("--profile", p)],
                     "--json", str(sim_json), "--warn-only"]) != 0:
            return 1
        resplit_predicted = json.loads(sim_json.read_text())["step_time_s"]
        retuned_run = run("the re-tuned plan, slowed from the start", retuned,
                          slow_path_of(retuned), 1, 6)
        resplit_run = run("the re-split plan, slowed from the start", resplit, slow_path, 1, 6)

    def steps_of(results, first, last=None):  # the steps first..last (counted from 1)
        return [t for res in results for n, t in enumerate(res.step_times, 2)
                if n >= first and (last is None or n <= last)]

    switches = [[n for n in r.rebalance if n.shares is not None] for r in moved]
    for k, (r, sw) in enumerate(zip(moved, switches)):
        if not sw:
            print(f"rebalanced run {k} moved no shares: "
                  + ("; ".join(n.message for n in r.rebalance) or "no replica drifted"))
    moved, switches = [r for r, sw in zip(moved, switches) if sw], [sw for sw in switches if sw]
    if not moved:
        return 1
    before = statistics.median(steps_of(kept + moved, 2, slow_from - 1))
    after_kept = statistics.median(steps_of(kept, slow_from + 1))
    after_moved = statistics.median(t for r, sw in zip(moved, switches)
                                    for t in steps_of([r], sw[0].from_step))
    retuned_predicted = retuned.prediction["step_time_s"]
    print(f"PP=2 x DP=2 rehearsal, 6 + 6 micro-batches, hidden {hidden}, 4 CPU ranks (time "
          f"scale {state['scale']:.2f}, nice {opts.nice}); {slow_path} ({SLOW_CARD}) 2.5x slower from step "
          f"{slow_from} of {steps}; {opts.repeats} run(s) of each, alternated; median step")
    print(f"  before the slowdown (steps 2..{slow_from - 1})              {before * 1e3:8.1f} ms")
    print(f"  after it, shares kept 6:6 (steps {slow_from + 1}..)            "
          f"{after_kept * 1e3:8.1f} ms")
    print(f"  after it, rebalanced (from the first step on new shares) {after_moved * 1e3:8.1f} ms")
    for r, sw in zip(moved, switches):
        print(f"    run: {'; '.join(f'{n.shares} from step {n.from_step}' for n in sw)} "
              f"({sw[0].from_step - slow_from} step(s) after the slowdown began)")
    print(f"  re-split: PP=2 x DP=2 at the tuner's split {split} of the measured costs")
    print(f"    predicted (simulate --profile, the run's profiles) {resplit_predicted * 1e3:8.1f} ms")
    print(f"    rehearsed, slowed from the start (steps 2..6)      "
          f"{resplit_run.step_s * 1e3:8.1f} ms")
    print(f"  re-tuned (tune --from-run): {retuned.sizes_text()}, layers {retuned.layer_split}, "
          f"micro-batches {[p.num_microbatches for p in retuned.meshes[0].pipelines]}")
    print(f"    predicted                                          {retuned_predicted * 1e3:8.1f} ms")
    print(f"    rehearsed, slowed from the start (steps 2..6)      "
          f"{retuned_run.step_s * 1e3:8.1f} ms")
    print(f"  rebalanced over kept {after_moved / after_kept:.3f}; over the re-split plan's "
          f"predicted step {after_moved / resplit_predicted:.3f}, its rehearsed step "
          f"{after_moved / resplit_run.step_s:.3f}; over the re-tuned plan's predicted step "
          f"{after_moved / retuned_predicted:.3f}, its rehearsed step "
          f"{after_moved / retuned_run.step_s:.3f} (target <= 1.10)")
    return 0


def _megatron(opts) -> int:
    opts.slow_from = opts.slow_from or 4
    opts.hidden = opts.hidden or 64
    plan = make_plan(split=(2, 2), replicas=[(1, 6), (1, 6)], hidden=opts.hidden, heads=4, seq=64)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "plan.yaml"
        save_plan(plan, path)
        even = _run(path, Path(tmp) / "even", iters=opts.iters)
        target = next(s for s in even[-1].stages if (s.replica, s.stage) == (1, 0))
        per_mb = statistics.median(
            next(s for s in r.stages if (s.replica, s.stage) == (1, 0)).measured.compute_s
            for r in even[2:]) / target.micro_batches
        sleep = 1.5 * per_mb  # compute 2.5x as long
        rank = plan.rank_of_slot(Slot(mesh=0, stage=0, replica=1, tensor_rank=0))
        env = {"TINY_SLOW": f"{rank}:{sleep:.6f}:{opts.slow_from}"}
        slow = _run(path, Path(tmp) / "slow", iters=opts.iters, env=env)
        fixed = _run(path, Path(tmp) / "rebalanced", iters=opts.iters, env=env,
                     extra=["--hetero-rebalance", "--hetero-rebalance-patience", "1"])
    first = opts.slow_from + 1  # Megatron's step that runs iteration slow_from
    before = statistics.median(r.step_time_s for r in even[2:])
    after_slow = statistics.median(r.step_time_s for r in slow if r.step >= first + 1)
    moves = [r.rebalance for r in fixed if r.rebalance and r.rebalance.shares]
    if not moves:
        print("the rebalanced run moved no shares", file=sys.stderr)
        return 1
    for r in fixed:
        if r.rebalance:
            print(f"  step {r.step}: {r.rebalance.message}", flush=True)
    settled = [m for m in moves if any(r.step > m.from_step for r in fixed)]
    if not settled:
        print("the shares moved at the last step: no step ran after it", file=sys.stderr)
        return 1
    moved = settled[0]  # every step from the first move on counts, later moves included
    after_fix = statistics.median(r.step_time_s for r in fixed if r.step > moved.from_step)
    costs = replica_costs(next(r for r in slow if r.step == opts.iters))
    counts = [p.num_microbatches for p in plan.pipelines]
    best = water_fill([a for a, _ in costs], [c for _, c in costs], sum(counts))
    # the plan that split the micro-batches so from the start, slowed alike: what re-tuning the
    # shares for the slowed card gives (its step after the slowdown)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "plan.yaml"
        save_plan(make_plan(split=(2, 2), replicas=[(1, best[0]), (1, best[1])],
                            hidden=opts.hidden, heads=4, seq=64), path)
        retuned = _run(path, Path(tmp) / "retuned", iters=opts.iters, env=env)
    after_best = statistics.median(r.step_time_s for r in retuned if r.step >= first + 1)
    priced = lambda shares: max(a + m * c for (a, c), m in zip(costs, shares))  # noqa: E731
    print(f"PP=2 x DP=2, 6+6 micro-batches, hidden {opts.hidden}, 4 CPU ranks; stage 0 of "
          f"replica 1 sleeps {sleep * 1e3:.1f} ms per forward from step {first} (2.5x its compute)")
    print(f"  median step before the slowdown     {before * 1e3:8.1f} ms")
    print(f"  after it, shares kept {counts}    {after_slow * 1e3:8.1f} ms")
    print(f"  after it, rebalanced from {moved.shares} {after_fix * 1e3:8.1f} ms  (moves: "
          + ", ".join(f"{m.shares} from step {m.from_step}" for m in moves)
          + f"; the first {moves[0].from_step - first} step(s) after the slowdown began)")
    print(f"  target: the best split {best} as the slowed run's measured costs price it "
          f"{priced(best) * 1e3:.1f} ms (its pipelines' compute only; kept shares priced "
          f"{priced(counts) * 1e3:.1f} ms)")
    print(f"  the plan split {best} from the start, slowed alike  {after_best * 1e3:8.1f} ms")
    print(f"  rebalanced over kept: {after_fix / after_slow:.3f}; rebalanced over the plan split "
          f"{best} from the start: {after_fix / after_best:.3f} (target <= 1.10)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
