#!/usr/bin/env python3
"""Step time of Megatron-LM training with the megatron-hetero hooks vs without, side by side.

Both runs use megatron.training.pretrain (the venv's megatron-core, 0.19.2) on the CPU backend with the
same tiny GPT, the same uniform plan and the same arguments: once through
``python -m megatron_hetero.launch ... --hetero-plan plan.yaml``, once as plain Megatron with the
plan's arguments spelled out (``megatron-hetero args``) and no hooks. Runs alternate (and swap order every repeat); each run's
figure is its median step time (warm-up steps dropped), and the ratio compares the fastest run
of each kind (the least disturbed by other load on the machine). Target: <= 1.01.

On a shared machine whole-run timings swing by 2x, so the script also measures what the hooks
add to a step directly: the per-replica schedule wrapper (the only hook on the step path, and
only for uneven plans) around a no-op schedule, against a call of the bare no-op.

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
            for name in (("plain", "plugin") if rep % 2 == 0 else ("plugin", "plain")):
                work = Path(tmp) / f"{name}{rep}"
                work.mkdir()
                results = launch(opts.nproc, str(path), work, iters=opts.iters,
                                 hooks=(name == "plugin"), timeout=900)
                for code, out, _ in results:
                    if code != 0:
                        print(out[-3000:], file=sys.stderr)
                        return 1
                steps = step_times_ms(results[-1][1])[opts.warmup:]
                times[name].append(statistics.median(steps))
                print(f"run {rep} {name:6s}: median step {statistics.median(steps):8.2f} ms "
                      f"over {len(steps)} steps", flush=True)
    plain, plugin = min(times["plain"]), min(times["plugin"])
    print(f"uniform plan, {opts.nproc} CPU ranks, hidden {opts.hidden}: fastest run's median "
          f"step: plain Megatron {plain:.2f} ms, with megatron-hetero {plugin:.2f} ms; "
          f"ratio plugin/plain = {plugin / plain:.4f} (target <= 1.01)")
    wrapper_us = _wrapper_cost_us()
    print(f"schedule wrapper (uneven plans only): {wrapper_us:.2f} us per step = "
          f"{wrapper_us / (plain * 1e3) * 100:.5f}% of the plain step above")
    return 0


def _wrapper_cost_us(calls: int = 200_000) -> float:
    """Extra microseconds per step the per-replica schedule wrapper costs (measured)."""
    import timeit
    from types import SimpleNamespace

    from megatron_hetero.runtime.core_run import CoreBackend, CoreRankState

    plan = make_plan(replicas=[(1, 3), (1, 1)])
    backend = CoreBackend(state=CoreRankState(
        plan=plan, plan_path="bench", launcher_rank=0, megatron_rank=0,
        device_type="A100-SXM-80GB", slot=plan.slot_of_rank(0), virtual_num_microbatches=2,
        args=SimpleNamespace(micro_batch_size=1)))

    def schedule(**kw):
        return kw

    wrapped = backend.replica_forward_backward(schedule)
    kw = dict(num_microbatches=2, micro_batch_size=1, forward_only=False)
    bare = min(timeit.repeat(lambda: schedule(**kw), number=calls, repeat=5))
    hooked = min(timeit.repeat(lambda: wrapped(**kw), number=calls, repeat=5))
    return (hooked - bare) / calls * 1e6


if __name__ == "__main__":
    sys.exit(main())
