#!/usr/bin/env python3
"""Time from a lost node to the first step of the new plan, on CPU ranks, part by part.

Plan A trains a tiny GPT on two CPU ranks playing an A100 stage and a V100 stage (Megatron-LM's
own pretrain_gpt.py with mock data when a Megatron-LM git clone is at $MEGATRON_LM_GIT, else the
tests' pretrain_gpt.py-style script; the venv's megatron-core 0.19.2 either way),
saves a torch_dist checkpoint at iteration 2 and ends there: the failure, as if the V100 node
were lost right after that save. Then, with one A100 left:

  re-plan     ``megatron-hetero replan CKPT inventory-a100.yaml -o plan-b.yaml`` (a process)
  restart     plan B's rank from process start to Megatron initialized (with pretrain_gpt.py:
              to pretrain() with the imports, then initialize), then to model and optimizer
              built (the load excluded)
  load        Megatron's load-checkpoint timer
  set-up      data loaders and the rest until the training loop starts
  first step  the first iteration under plan B (Megatron's elapsed time per iteration)

It prints each part, their total from the failure to the end of the first step, a later step
for comparison, and the checkpoint's size and save time (Megatron's save-checkpoint timer).
Figures of one run on a shared machine; nothing here is asserted on time.

    .venv/bin/python scripts/bench_recovery.py [--hidden 64] [--layers 4] [--script PATH]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from importlib.metadata import version
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_hetero.launch.checkpoint import read_checkpoint  # noqa: E402
from megatron_hetero.plan import load_plan, save_plan  # noqa: E402
from tests.runtime.launching import (BASE_ARGS, PRETRAIN_GPT_ARGS, TRAIN_SCRIPT,  # noqa: E402
                                     launch, megatron_lm_checkout)
from tests.runtime.plans import A100, V100, make_plan  # noqa: E402

MEGATRON_GIT = os.environ.get("MEGATRON_LM_GIT")  # a Megatron-LM git clone, only from here
_STAMP = r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+)"


def _pretrain_gpt(tmp: Path) -> Path | None:
    """The pretrain_gpt.py of the venv's megatron-core's Megatron-LM release (core_v0.19.0) and
    what it imports, from the git clone."""
    if not MEGATRON_GIT:
        return None
    return megatron_lm_checkout(tmp) / "pretrain_gpt.py"


def _stamp(output: str, marker: str, *, required: bool = True) -> float | None:
    """Epoch seconds of Megatron's ``[marker] datetime: ...`` line (its local clock)."""
    m = re.search(re.escape(marker) + r"\] datetime: " + _STAMP, output)
    if not m:
        if not required:
            return None
        raise SystemExit(f"no '{marker}' line in the run's output")
    return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S.%f").timestamp()


def _timer_ms(output: str, name: str) -> float:
    """The max over ranks of Megatron's timer ``name`` (ms)."""
    m = re.search(re.escape(name) + r" \.+: \(([\d.]+), ([\d.]+)\)", output)
    if not m:
        raise SystemExit(f"no '{name}' timer in the run's output")
    return float(m.group(2))


def _iterations(output: str) -> list[tuple[int, float, float]]:
    """(iteration, end time in epoch seconds, elapsed ms) of each logged iteration."""
    rows = re.findall(r"\[" + _STAMP + r"\] iteration\s+(\d+)/\s*\d+ .*?elapsed time per "
                      r"iteration \(ms\): ([\d.]+)", output)
    return [(int(i), datetime.strptime(t, "%Y-%m-%d %H:%M:%S.%f").timestamp(), float(ms))
            for t, i, ms in rows]


def _check(results) -> None:
    for code, out, _ in results:
        if code != 0:
            print(out[-3000:], file=sys.stderr)
            raise SystemExit(1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4, help="layers (split evenly over A's 2 stages)")
    parser.add_argument("--script", metavar="PATH",
                        help="the training script (default: Megatron-LM's pretrain_gpt.py, else "
                             "the tests' script)")
    opts = parser.parse_args()
    half = opts.layers // 2
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        script = Path(opts.script) if opts.script else _pretrain_gpt(tmp)
        base = PRETRAIN_GPT_ARGS if script is not None else BASE_ARGS
        script = script or TRAIN_SCRIPT
        plan_a, plan_b, ckpt = tmp / "plan-a.yaml", tmp / "plan-b.yaml", tmp / "ckpt"
        save_plan(make_plan(split=(half, opts.layers - half), devices=[[A100, V100]],
                            replicas=[(1, 4)], hidden=opts.hidden, seq=64), plan_a)
        inventory = tmp / "inventory-a100.yaml"
        inventory.write_text("groups:\n  - {gpu: A100-SXM-80GB, nodes: 1, gpus_per_node: 1}\n")
        common = ["--train-iters", "4", "--ckpt-format", "torch_dist"]

        (tmp / "a").mkdir()
        first = launch(2, str(plan_a), tmp / "a", iters=4, script=script, base_args=base,
                       timeout=900, extra=[*common, "--save", str(ckpt), "--save-interval", "2",
                                           "--exit-interval", "2"])
        failed = time.time()
        _check(first)
        save_ms = _timer_ms("\n".join(o for _, o, _ in first), "save-checkpoint")
        saved = read_checkpoint(ckpt)

        t0 = time.time()
        replan = subprocess.run([sys.executable, "-m", "megatron_hetero.cli", "replan", str(ckpt),
                                 str(inventory), "-o", str(plan_b)], capture_output=True,
                                text=True, cwd=tmp, env={**os.environ, "PYTHONPATH": str(REPO)})
        replan_s = time.time() - t0
        if replan.returncode:
            print(replan.stderr, file=sys.stderr)
            return 1
        b = load_plan(plan_b)

        (tmp / "b").mkdir()
        started = time.time()
        second = launch(b.world_size, str(plan_b), tmp / "b", iters=4, script=script,
                        base_args=base, timeout=900, extra=[*common, "--load", str(ckpt)])
        _check(second)
        out = "\n".join(o for _, o, _ in second)
        load_s = _timer_ms(out, "load-checkpoint") / 1e3
        initialized = _stamp(out, "after megatron is initialized")
        # pretrain_gpt.py records when pretrain() began (megatron-core's start-up stamps)
        entered = _stamp(out, "before megatron-init", required=False)
        built = _stamp(out, "after model, optimizer, and learning rate scheduler are built")
        loop = _stamp(out, "before the start of training step")
        steps = _iterations(out)
        (it, first_end, first_ms), later = steps[0], steps[1:]

    if entered is not None:
        restart = [("restart: process start to pretrain() (imports)", entered - started),
                   ("restart: Megatron initialized (initialize_megatron)", initialized - entered)]
    else:
        restart = [("restart: process start to Megatron initialized", initialized - started)]
    parts = [("re-plan (megatron-hetero replan)", replan_s), *restart,
             ("restart: model and optimizer built", built - load_s - initialized),
             ("checkpoint load", load_s),
             ("set-up (data loaders) until the loop", loop - built),
             (f"first step (iteration {it})", first_ms / 1e3)]
    print(f"training script: {script.name} (megatron-core {version('megatron-core')}'s "
          f"megatron.training), "
          f"CPU ranks, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"plan A: {opts.layers} layers, hidden {opts.hidden}, 2 ranks (A100 stage "
          f"{half} layers, V100 stage {opts.layers - half}); failure after the save of iteration "
          f"{saved.iteration}; plan B: TP={b.tensor_model_parallel_size} "
          f"PP={b.pipeline_model_parallel_size} DP={b.data_parallel_size} on {b.world_size} A100")
    print(f"checkpoint: {saved.format}, {saved.size_bytes / 1e6:.2f} MB "
          f"({saved.size_bytes} bytes), saved in {save_ms / 1e3:.2f} s")
    for name, seconds in parts:
        print(f"  {name:48s} {seconds:7.2f} s")
    print(f"  {'sum of the parts':48s} {sum(s for _, s in parts):7.2f} s")
    print(f"failure to end of first step (wall): {first_end - failed:.2f} s "
          f"(the parts plus the gaps between them)")
    if later:
        print(f"a later step under plan B (iteration {later[0][0]}): {later[0][2] / 1e3:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
