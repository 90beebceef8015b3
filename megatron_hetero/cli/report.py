"""``megatron-hetero report DIR``: the handler (:mod:`megatron_hetero.telemetry.report` does
the work). No torch."""

from __future__ import annotations

import json
from pathlib import Path

from ..hardware.inventory import load_inventory
from ..outputs import Outputs
from ..plan import load_any_plan
from ..telemetry.prediction import implied_inventory, plan_cost_model
from ..telemetry.records import TELEMETRY_FILE, read_records
from ..telemetry.report import pick, report_lines, slow_stages, summarize, timelines_png

__all__ = ["report_main"]


def report_main(args) -> int:
    records = pick(read_records(args.dir), args.step)
    stages = summarize(records)
    outputs = {"--timeline": args.timeline, "--json": args.json}
    folder = Path(args.dir)
    inputs = {"DIR/telemetry.jsonl": str(folder / TELEMETRY_FILE),
              "DIR/plan.yaml": str(folder / "plan.yaml")}
    with Outputs("report", inputs=inputs, outputs=outputs) as out:
        from rich.console import Console

        console = Console(soft_wrap=True)
        table, lines = report_lines(records, stages, threshold=args.threshold, source=args.dir)
        console.print(table, soft_wrap=False)
        for line in lines:
            console.print(line, highlight=False)
        if args.json:
            slow, median = slow_stages(stages, threshold=args.threshold)
            data = {"steps": [r.step for r in records], "median_ratio": median,
                    "stages": [{"path": s.path, "replica": s.replica, "device_type": s.device_type,
                                "ratio": s.ratio} for s in stages],
                    "slow": [{"path": s.path, "replica": s.replica, "over_median": over}
                             for s, over in slow]}
            with open(out.staged(args.json), "w") as f:
                json.dump(data, f, indent=2)
        if args.timeline:
            record = records[-1]
            events, seconds = _predicted_events(Path(args.dir), args.inventory)
            timelines_png(record, events, seconds, out.staged(args.timeline))
            console.print(f"wrote {args.timeline}", highlight=False)
    return 0


def _predicted_events(directory: Path, inventory_path: str | None):
    """The simulator's events of the run's plan (``DIR/plan.yaml``), or (None, None) where the
    folder has no plan."""
    from ..sim.step import simulate

    path = directory / "plan.yaml"
    if not path.is_file():
        return None, None
    inventory = load_inventory(inventory_path) if inventory_path else None
    plan = load_any_plan(str(path), catalog=inventory.catalog if inventory else None)
    inventory = inventory or implied_inventory(plan)
    sim = simulate(plan, plan_cost_model(plan, inventory), record_events=True)
    return sim.events, sim.step_time_s
