#!/usr/bin/env python
"""The heterogeneity-aware 1F1B (per-stage warm-up) against Megatron's 1F1B, side by side.

On the two slow-link scenarios (two sites joined by 1 Gb/s and by 10 Gb/s) it prints, in one
run:

1. *Predicted, whole pool.* The pool tuned three ways: non-interleaved under Megatron's 1F1B,
   the same search with per-stage warm-ups (the gain is the simulator's, on the same plan), and
   the full search (interleaving allowed; a non-interleaved plan with warm-ups may win it).
2. *Rehearsed on CPU ranks with link emulation.* The first pipeline of the warm-up search's
   plan (one data-parallel replica: its stages, layers, micro-batches and tensor-parallel size,
   at most 16 CPU ranks) rehearsed under both schedules (``megatron-hetero rehearse
   --emulate-links``): every pipeline message waits the inventory's link, scaled like the
   compute. Where the tuner kept Megatron's counts, the warm-up schedule rehearsed is Harp's own
   rule for ``δ`` (:func:`~megatron_hetero.tuner.warmup.harp_warmups`), or where that keeps
   them too, one more warm-up forward across the slowest link. Each schedule is
   rehearsed ``--repeats`` times, alternating; the table has the medians of the measured step,
   of the prediction for the emulated cluster (with its links) and their ratio, and the measured
   gain beside the predicted one. Memory caps are off (this measures time). Every device is
   slowed 4x more (``--time-scale``): at the rehearsal's own default (compute within 70 % of
   the cores) the four ranks of a TP=2 pipeline ran about 30 % behind the prediction on this
   2-core machine, both schedules alike; with the ranks mostly asleep they do not.

3. *Latency-dominated check of the simulator's send model.* A tiny 2-stage model (3 + 3
   layers, 8 micro-batches) whose every pipeline message waits ``--latency`` seconds (50 ms),
   trained under Megatron's 1F1B and under warm-ups of 3 and 7 on the first stage; beside the
   fastest measured step, the simulator's step fed with the ranks' measured forward and
   backward seconds, once as the simulator runs (Megatron's 1F1B holds a stage until each send
   has crossed the link) and once with every send free for the sender. Compute is a few ms
   here, so other load hardly moves it.

``--timeline DIR`` also draws the first pipeline of the 1 Gb/s plan under both schedules
(DIR/warmup-<scenario>-megatron.png and -warmup.png). ``--no-rehearse`` prints part 1 only.
The rehearsal needs a quiet machine: other load stretches the ranks' compute (the rehearsal
report's drift note).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _trees  # noqa: E402

_trees.use_tree()

from bench_tuner import SCENARIOS, load_scenario  # noqa: E402
from megatron_hetero.cost.model import CostModel  # noqa: E402
from megatron_hetero.plan import Plan, plan_from_data, replace_grid  # noqa: E402
from megatron_hetero.sim.step import simulate  # noqa: E402
from megatron_hetero.tuner import TuneOptions, tune  # noqa: E402
from megatron_hetero.tuner.warmup import harp_warmups, with_warmups  # noqa: E402

DEFAULT = ("a100-v100-1gbps-llama2-13b", "a100-v100-10gbps-llama2-13b")


def _flat(warmup: bool) -> TuneOptions:
    return TuneOptions(per_stage_warmup=warmup, max_virtual_pipeline_size=1,
                       refine_max_virtual_pipeline_size=1)


def _warmups(plan: Plan, d: int = 0) -> list:
    return [st.warmup_microbatches for st in plan.pipelines[d].stages]


def _describe(plan: Plan) -> str:
    return (f"TP{plan.tensor_model_parallel_size} PP{plan.pipeline_model_parallel_size} "
            f"VP{plan.virtual_pipeline_size} DP{plan.data_parallel_size} warm-ups {_warmups(plan)}")


def megatron_counts(plan: Plan) -> Plan:
    """``plan`` with every stage at Megatron's warm-up."""
    return replace_grid(plan, pipelines=[
        dataclasses.replace(pipe, stages=[dataclasses.replace(st, warmup_microbatches=None)
                                          for st in pipe.stages])
        for pipe in plan.pipelines])


def first_pipeline(plan: Plan, catalog) -> Plan:
    """``plan``'s first data-parallel replica alone, with that replica's share of the batch."""
    data = plan.to_data()
    pipe = data["pipelines"][0]
    data.update(pipelines=[pipe], global_batch_size=pipe["micro_batch_size"] *
                pipe["num_microbatches"])
    data.pop("prediction", None)
    return plan_from_data(data, source="<first pipeline>", catalog=catalog)


def rehearse_both(plans: dict[str, Plan], inventory, *, repeats: int, steps: int, hidden: int,
                  nice: int, time_scale: float | None) -> dict[str, dict[str, float]]:
    """Each of ``plans`` rehearsed ``repeats`` times with link emulation, in turn: per plan the
    medians of the measured step (``measured``), its prediction (``predicted``) and their
    ratio (``ratio``)."""
    from megatron_hetero.emulate.rehearse import RehearsalConfig, rehearse

    config = RehearsalConfig(steps=steps, hidden_size=hidden, emulate_links=True,
                             memory_cap=False, nice=nice, time_scale=time_scale)
    got: dict[str, list] = {name: [] for name in plans}
    for k in range(repeats):
        for name, plan in plans.items():
            r = rehearse(plan, config, inventory=inventory, progress=lambda msg: None)
            got[name].append((r.step_s, r.predicted_step_s))
            print(f"  [{k + 1}/{repeats}] {name}: measured {r.step_s:.3f} s, predicted "
                  f"{r.predicted_step_s:.3f} s", file=sys.stderr, flush=True)
    return {name: {"measured": statistics.median(m for m, _ in runs),
                   "predicted": statistics.median(p for _, p in runs),
                   "ratio": statistics.median(m / p for m, p in runs)}
            for name, runs in got.items()}


def _stack(images: list[Path], target: Path, *, titles: list[str]) -> None:
    """The timeline pictures ``images`` one above the other, titled, in one PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.image as mpimg
    import matplotlib.pyplot as plt

    pictures = [mpimg.imread(str(p)) for p in images]
    width = max(p.shape[1] for p in pictures) / 120
    fig, axes = plt.subplots(len(pictures), 1, figsize=(width, sum(
        p.shape[0] / 120 + 0.3 for p in pictures)))
    for ax, picture, title in zip(axes, pictures, titles):
        ax.imshow(picture)
        ax.set_title(title, fontsize=10)
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(target, dpi=120)
    plt.close(fig)


def _timed_hooks(plan: Plan, rank: int, *, latency_s: float):
    """Rank hooks: every pipeline message ``latency_s`` late; each kind of compute step timed."""
    from megatron_hetero.emulate.links import emulate_links, plan_links
    from megatron_hetero.emulate.trainer import RankHooks
    from megatron_hetero.hardware.inventory import inventory_from_data

    inventory = inventory_from_data({"groups": [{"gpu": "A100-SXM-80GB", "nodes": plan.world_size,
                                                 "gpus_per_node": 1}]})
    emulate_links(plan_links(plan, inventory, latency_s=latency_s), rank)
    times: dict[str, list[float]] = {"forward": [], "backward": []}

    class _Timed:
        def __init__(self, kind):
            self.kind = kind

        def __enter__(self):
            self.t0 = time.perf_counter()

        def __exit__(self, *exc):
            times[self.kind].append(time.perf_counter() - self.t0)
            return False

    return RankHooks(compute=_Timed,
                     report=lambda: {k: statistics.median(v) for k, v in times.items()})


def latency_check(latency_s: float, *, steps: int = 4) -> list[str]:
    """Part 3 of the module docstring: one line per schedule."""
    import functools

    from megatron_hetero.emulate.trainer import TrainConfig, train_plan
    from megatron_hetero.schedule.rules import pipeline_warmups
    from megatron_hetero.sim.pipeline import pipeline_run

    base = plan_from_data({
        "format_version": 1, "precision": "fp32", "global_batch_size": 8,
        "tensor_model_parallel_size": 1,
        "model": {"name": "tiny", "num_layers": 6, "hidden_size": 32, "ffn_hidden_size": 64,
                  "num_attention_heads": 4, "num_query_groups": 4, "vocab_size": 64,
                  "seq_length": 8},
        "pipelines": [{"micro_batch_size": 1, "num_microbatches": 8, "stages": [
            {"device_type": "A100-SXM-80GB", "num_layers": 3},
            {"device_type": "A100-SXM-80GB", "num_layers": 3}]}]})
    config = TrainConfig(steps=steps, gather_params=False, eval_forward_only=False)
    lines = []
    for w in (None, 3, 7):
        plan = base if w is None else with_warmups(base, [w])  # stage 0: the last's 0 + w
        got = train_plan(plan, config, hooks_factory=functools.partial(_timed_hooks,
                                                                       latency_s=latency_s))
        measured = min(max(r.step_times[k] for r in got.ranks) for k in range(1, steps))
        ranks = sorted(got.ranks, key=lambda r: r.stage)
        f, b = [[r.extra["forward"]] for r in ranks], [[r.extra["backward"]] for r in ranks]
        sends = [latency_s, latency_s]
        counts = tuple(pipeline_warmups(plan.pipelines[0]))
        model = max(pipeline_run(f, b, sends, sends, 8,
                                 warmups=None if w is None else counts)[0])
        free = max(pipeline_run(f, b, sends, sends, 8, warmups=counts)[0])  # never blocks
        lines.append(f"{'Megatron 1F1B' if w is None else f'warm-up {w}':14s} {measured:9.3f} "
                     f"{model:9.3f} {measured / model - 1:+6.1%} {free:12.3f}")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--timeline", metavar="DIR", help="draw both schedules' timelines here")
    ap.add_argument("--no-rehearse", action="store_true", help="predictions only")
    ap.add_argument("--repeats", type=int, default=3, help="rehearsals per schedule (median)")
    ap.add_argument("--steps", type=int, default=3, help="steps per rehearsal (first: warm-up)")
    ap.add_argument("--hidden-size", type=int, default=32, help="the rehearsal's shrunk width")
    ap.add_argument("--time-scale", type=float, default=4.0,
                    help="extra slowdown of every emulated device (default 4: the ranks then "
                         "leave most of the cores idle, so the link, not contention, is measured)")
    ap.add_argument("--nice", type=int, default=-15 if os.geteuid() == 0 else 0,
                    help="os.nice of the rehearsal's ranks (default -15 as root)")
    ap.add_argument("--latency", type=float, default=0.05,
                    help="seconds per message of part 3's latency-dominated check")
    ap.add_argument("scenarios", nargs="*")
    args = ap.parse_args(argv)
    paths = [Path(p) for p in args.scenarios] or [SCENARIOS / f"{n}.yaml" for n in DEFAULT]
    print(f"{'scenario':30s} {'1F1B s':>8s} {'warm-up s':>9s} {'gain':>6s} {'full s':>8s}"
          f"  plan (warm-up search)")
    rehearsals = []
    for path in paths:
        inventory, model, gbs, _ = load_scenario(path)
        warm = tune(model, inventory, gbs, options=_flat(True))
        plain = warm.sim.step_time_s * warm.warmup_gain  # the same plan, Megatron's counts
        full = tune(model, inventory, gbs, options=TuneOptions())
        print(f"{path.stem:30s} {plain:8.2f} {warm.sim.step_time_s:9.2f} {warm.warmup_gain:6.3f} "
              f"{full.sim.step_time_s:8.2f}  {_describe(warm.plan)}; full search: "
              f"{_describe(full.plan)}", flush=True)
        cost = CostModel(model, inventory, precision=warm.plan.precision,
                         **TuneOptions().cost_options)
        megatron = megatron_counts(warm.plan)
        if args.timeline and warm.warmup_gain > 1.0:
            out = Path(args.timeline)
            drawn, longest = [], 1.02 * max(plain, warm.sim.step_time_s)  # one time axis
            for name, plan in (("megatron", megatron), ("warmup", warm.plan)):
                drawn.append(out / f"warmup-{path.stem}-{name}.png")
                simulate(plan, cost).timeline_png(drawn[-1], max_pipelines=1, seconds=longest)
            _stack(drawn, out / f"warmup-{path.stem}-both.png",
                   titles=["Megatron's 1F1B", f"per-stage warm-up {_warmups(warm.plan)}"])
        ours, rule = warm.plan, "tuner's"
        if warm.warmup_gain <= 1.0:
            ours, rule = harp_warmups(megatron, simulate(megatron, cost, record_events=False),
                                      cost), "Harp's rule"
        if ours.pipelines[0] == megatron.pipelines[0]:  # Harp's rule keeps Megatron's too
            bws = cost.placement(megatron).path_links(0, 0, False)
            slowest = min(range(len(bws)), key=bws.__getitem__)
            ours = with_warmups(megatron, [2 if s == slowest else 1 for s in range(len(bws))])
            rule = "one more across the slowest link"
        rehearsals.append((path.stem, megatron, ours, rule, inventory))
    print("\n1F1B s: the non-interleaved tuned plan under Megatron's 1F1B; warm-up s: the same "
          "plan with the per-stage warm-ups the tuner chose (gain = 1F1B / warm-up); "
          "full s: the full search (interleaving allowed).")
    if args.no_rehearse:
        return 0
    print("\nRehearsed on CPU ranks with link emulation: each plan's first pipeline, "
          f"medians of {args.repeats} (measured / predicted for the emulated cluster)")
    print(f"{'scenario':30s} {'warm-ups':>12s} {'1F1B meas':>9s} {'pred':>7s} {'err':>6s} "
          f"{'warm meas':>9s} {'pred':>7s} {'err':>6s} {'gain meas':>9s} {'pred':>6s}")
    for stem, megatron, ours, rule, inventory in rehearsals:
        one = {"1F1B": first_pipeline(megatron, inventory.catalog),
               "warm-up": first_pipeline(ours, inventory.catalog)}
        got = rehearse_both(one, inventory, repeats=args.repeats, steps=args.steps,
                            hidden=args.hidden_size, nice=args.nice,
                            time_scale=args.time_scale)
        a, b = got["1F1B"], got["warm-up"]
        print(f"{stem:30s} {str(_warmups(ours)):>12s} {a['measured']:9.3f} {a['predicted']:7.3f} "
              f"{a['ratio'] - 1:+6.1%} {b['measured']:9.3f} {b['predicted']:7.3f} "
              f"{b['ratio'] - 1:+6.1%} {a['measured'] / b['measured']:9.3f} "
              f"{a['predicted'] / b['predicted']:6.3f}  ({rule})", flush=True)
    print("\nmeas: the rehearsed step (s, emulated cluster); pred: the tuner's cost model and "
          "simulator for the same emulated cluster and links; err: measured / predicted - 1; "
          "gain: 1F1B step / warm-up step.")
    print(f"\nLatency-dominated check: tiny PP=2 model, 8 micro-batches, every message "
          f"{args.latency * 1e3:.0f} ms late (fastest of 3 steps)")
    print(f"{'schedule':14s} {'measured':>9s} {'simulated':>9s} {'err':>6s} {'senders free':>12s}")
    for line in latency_check(args.latency):
        print(line, flush=True)
    print("simulated: the simulator on the ranks' measured compute (Megatron's 1F1B waits for "
          "each send); senders free: the same with no sender waiting")
    return 0


if __name__ == "__main__":
    sys.exit(main())
