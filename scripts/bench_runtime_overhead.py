#!/usr/bin/env python3
"""Step time of Megatron-LM training with the megatron-hetero hooks vs without, side by side.

Both runs use megatron.training.pretrain (megatron-core 0.17.1's) on the CPU backend with the
same tiny GPT, the same uniform plan and the same arguments: once through
``python -m megatron_hetero.launch ... --hetero-plan plan.yaml``, once as plain Megatron with the
plan's arguments spelled out (``megatron-hetero args``) and no hooks. Runs alternate; the
figure is the ratio of median step times (warm-up steps dropped). Target: <= 1.01.

    .venv/bin/python scripts/bench_runtime_overhead.py [--iters 30] [--repeats 3] [--nproc 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_hetero.plan import save_plan  # noqa: E402
from tests.runtime.launching import launch, step_times_ms  # noqa: E402
from tests.runtime.plans import make_plan  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2, help="data-parallel replicas")
    parser.add_argument("--hidden", type=int, default=64)
    opts = parser.parse_args()
    plan = make_plan(split=(4,), replicas=[(2, 4)] * opts.nproc, hidden=opts.hidden, heads=4,
                     seq=64)
    times = {"plain": [], "plugin": []}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "plan.yaml"
        save_plan(plan, path)
        for rep in range(opts.repeats):
            for name in ("plain", "plugin"):
                work = Path(tmp) / f"{name}{rep}"
                work.mkdir()
                results = launch(opts.nproc, str(path), work, iters=opts.iters,
                                 hooks=(name == "plugin"), timeout=900)
                for code, out, _ in results:
                    if code != 0:
                        print(out[-3000:], file=sys.stderr)
                        return 1
                steps = step_times_ms(results[-1][1])[opts.warmup:]
                times[name] += steps
                print(f"run {rep} {name:6s}: median step {statistics.median(steps):8.2f} ms "
                      f"over {len(steps)} steps", flush=True)
    plain, plugin = statistics.median(times["plain"]), statistics.median(times["plugin"])
    print(f"uniform plan, {opts.nproc} CPU ranks, hidden {opts.hidden}: plain Megatron "
          f"{plain:.2f} ms/step, with megatron-hetero {plugin:.2f} ms/step; "
          f"ratio plugin/plain = {plugin / plain:.4f} (target <= 1.01)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
