#!/usr/bin/env python3
"""Live rebalancing against a stage that turns 2.5x slower, side by side in one run.

Megatron's own training loop (the venv's megatron-core 0.19.2 and its ``megatron.training``; the tests' tiny
GPT) on 4 CPU ranks: PP=2 x DP=2, each replica 6 micro-batches. Four runs:

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

    .venv/bin/python scripts/bench_rebalance.py [--iters 16] [--slow-from 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_hetero.plan import Slot, save_plan  # noqa: E402
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
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=16)
    parser.add_argument("--slow-from", type=int, default=4, help="iteration the slowdown starts")
    parser.add_argument("--hidden", type=int, default=64)
    opts = parser.parse_args()
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
