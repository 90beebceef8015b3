#!/usr/bin/env python3
"""What ``--hetero-telemetry`` costs a training step, side by side in one run.

Megatron's own training loop (the venv's megatron-core 0.19.2 and its ``megatron.training``) on
CPU ranks, the same tiny GPT and uneven plan each time: without telemetry, reporting every 10th step (the
default) and every step (the worst case: every step gathered to rank 0 and written). Runs
alternate and swap order every repeat; each run's figure is the mean step time over its steps
after the warm-up (the mean, not the median: a report every 10th step is a cost paid once in 10
steps), and each ratio compares the fastest run of each kind (the least disturbed by other load).

It also measures directly what a hooked call costs when its step is not armed (the telemetry's
only work on 9 steps of 10), against the hooked function called bare.

On CPU ranks a mark is ``time.perf_counter``; on a GPU it is a CUDA event (recorded on the
stream, read after the step), which this script does not measure.

    .venv/bin/python scripts/bench_telemetry.py [--iters 40] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import timeit
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_hetero.plan import save_plan  # noqa: E402
from tests.runtime.launching import launch, step_times_ms  # noqa: E402
from tests.runtime.plans import A100, V100, make_plan  # noqa: E402

KINDS = {"off": [], "every 10": ["--hetero-telemetry-interval", "10"],
         "every step": ["--hetero-telemetry-interval", "1"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=64)
    opts = parser.parse_args()
    plan = make_plan(split=(2, 2), devices=[[A100, V100]] * 2, replicas=[(1, 6), (1, 2)],
                     hidden=opts.hidden, heads=4, seq=64)
    means: dict[str, list[float]] = {k: [] for k in KINDS}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "plan.yaml"
        save_plan(plan, path)
        order = list(KINDS)
        for rep in range(opts.repeats):
            for kind in (order if rep % 2 == 0 else order[::-1]):
                work = Path(tmp) / f"{kind.replace(' ', '-')}{rep}"
                work.mkdir()
                extra = [] if kind == "off" else ["--hetero-telemetry", str(work / "tel"),
                                                  *KINDS[kind]]
                results = launch(4, str(path), work, iters=opts.iters, extra=extra, timeout=900)
                for code, out, _ in results:
                    if code != 0:
                        print(out[-3000:], file=sys.stderr)
                        return 1
                steps = max((step_times_ms(out) for _, out, _ in results), key=len)[opts.warmup:]
                means[kind].append(statistics.fmean(steps))
                print(f"run {rep} {kind:10s}: mean step {means[kind][-1]:8.2f} ms over "
                      f"{len(steps)} steps (median {statistics.median(steps):.2f})", flush=True)
    base = min(means["off"])
    print(f"PP=2 x DP=2 uneven (6:2 micro-batches), hidden {opts.hidden}, 4 CPU ranks; fastest "
          f"run's mean step: no telemetry {base:.2f} ms")
    for kind in ("every 10", "every step"):
        best = min(means[kind])
        print(f"  telemetry {kind:10s}: {best:.2f} ms, ratio {best / base:.4f}")
    idle_us = _idle_call_us()
    calls = 2 * 6 + 3  # forwards and backwards of the busiest rank, the step, sync, optimizer
    print(f"a hooked call on a step that is not armed: {idle_us:.3f} us more than the bare call; "
          f"{calls} calls a step = {calls * idle_us / (base * 1e3) * 100:.4f}% of the step above")
    return 0


def _idle_call_us(calls: int = 200_000) -> float:
    """Microseconds a hooked call adds when its step is not armed (measured)."""
    from megatron_hetero.runtime.telemetry import Telemetry
    from megatron_hetero.telemetry.collect import WallClock

    tel = Telemetry(directory=Path("."), interval=10, plan=None, plan_path="", slot=None,
                    device_type="", inventory=None, clock=WallClock(), layer_spec="local")

    def original(*a, **kw):
        return None

    bare = min(timeit.repeat(lambda: original(1, 2, x=3), number=calls, repeat=5))
    hooked = min(timeit.repeat(lambda: tel.forward_step(original, 1, 2, x=3), number=calls,
                               repeat=5))
    return (hooked - bare) / calls * 1e6


if __name__ == "__main__":
    sys.exit(main())
