#!/usr/bin/env python3
"""Predicted against measured from the GPU runs kept under docs/gpu/ (scripts/gpu_evidence.py).

    .venv/bin/python scripts/gpu_evidence_figure.py [docs/gpu/run1 ...] [--png FILE]

For each run folder: the step time and peak memory Megatron-LM measured, against what the cost
model predicts *now* from that run's own profile (simulate with --profile) and from the catalog
alone. Prints a Markdown table and draws the figure of docs/gpu.md. No GPU and no torch needed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def predict(run: Path, plan_name: str, *, profile: Path | None) -> dict:
    from megatron_hetero.cost import CostModel
    from megatron_hetero.cost.profile_file import load_profiles
    from megatron_hetero.hardware.inventory import load_inventory
    from megatron_hetero.plan import load_plan
    from megatron_hetero.sim.step import simulate

    inventory = load_inventory(run / "inventory.yaml")
    plan = load_plan(run / plan_name, catalog=inventory.catalog)
    profiles = load_profiles([profile], catalog=inventory.catalog) if profile else {}
    cost = CostModel(plan.model, inventory, profiles=profiles, precision=plan.precision,
                     use_distributed_optimizer=plan.use_distributed_optimizer)
    sim = simulate(plan, cost, record_events=False)
    return {"step_s": sim.step_time_s, "memory_gb": sim.stages[0].memory.total / 1e9}


def rows(runs: list[Path], *, profile: Path | None = None) -> list[dict]:
    """One row per training run kept in ``runs``; predicted from each run's own profile, or
    from ``profile`` for all."""
    import yaml

    out = []
    info_file = runs[0].parent / "runs.yaml" if runs else None
    runs_info = yaml.safe_load(info_file.read_text()) if info_file and info_file.exists() else {}
    for run in runs:
        ev = json.loads((run / "evidence.json").read_text())
        own = profile is None
        softmax = runs_info.get((run if own else profile.parent).name, {}).get(
            "profile_softmax", "?")
        if "shapes" in ev:  # gpu_evidence.py in parts: one plan and profile per shape
            out += shape_rows(run, ev, profile, softmax)
        for name, m in ev.get("measured", {}).items():
            if not m["ok"] or m["median_step_s"] is None:
                continue
            plan = "plan_offload.yaml" if name.startswith("hetero_plan_offload") else "plan.yaml"
            prof, cat = (predict(run, plan, profile=p)
                         for p in ((run / "profile.yaml") if own else profile, None))
            out.append({"run": f"{run.name}/{name}", "plan": plan, "profile_softmax": softmax,
                        "measured_s": m["median_step_s"],
                        "measured_gb": m["max_allocated_mb"] * 2**20 / 1e9,
                        "megatron_theoretical_gb": (m["megatron_theoretical_mb"] or 0) * 2**20
                        / 1e9, "profile_s": prof["step_s"], "profile_gb": prof["memory_gb"],
                        "catalog_s": cat["step_s"], "catalog_gb": cat["memory_gb"]})
    return out


def shape_rows(run: Path, ev: dict, profile: Path | None, softmax: str) -> list[dict]:
    out = []
    for name, shape in ev["shapes"].items():
        m = shape.get("measured") or {}
        if not m.get("ok") or m.get("median_step_s") is None:
            continue
        plan = f"shape-{name}/plan.yaml"
        own = run / f"profile-s{shape['seq_length']}" / "profile.yaml"
        prof, cat = (predict(run, plan, profile=p) for p in (profile or own, None))
        out.append({"run": f"{run.name}/{name}", "plan": plan, "profile_softmax": softmax,
                    "measured_s": m["median_step_s"],
                    "measured_gb": m["max_allocated_mb"] * 2**20 / 1e9,
                    "megatron_theoretical_gb": (m["megatron_theoretical_mb"] or 0) * 2**20 / 1e9,
                    "profile_s": prof["step_s"], "profile_gb": prof["memory_gb"],
                    "catalog_s": cat["step_s"], "catalog_gb": cat["memory_gb"]})
    return out


def table(found: list[dict]) -> str:
    head = ("| run | profile's softmax | measured s | predicted s, profile | error | predicted s, "
            "catalog | error | measured GB | predicted GB, profile | error | predicted GB, "
            "catalog | error | Megatron's theoretical GB |\n|" + "---|" * 13)
    err = lambda p, m: f"{(p - m) / m:+.1%}" if m else "-"  # noqa: E731
    lines = [head]
    for r in found:
        lines.append(
            f"| {r['run']} | {r['profile_softmax']} | {r['measured_s']:.3f} | "
            f"{r['profile_s']:.3f} | {err(r['profile_s'], r['measured_s'])} | "
            f"{r['catalog_s']:.3f} | {err(r['catalog_s'], r['measured_s'])} | "
            f"{r['measured_gb']:.1f} | {r['profile_gb']:.1f} | "
            f"{err(r['profile_gb'], r['measured_gb'])} | {r['catalog_gb']:.1f} | "
            f"{err(r['catalog_gb'], r['measured_gb'])} | {r['megatron_theoretical_gb']:.1f} |")
    return "\n".join(lines)


def figure(found: list[dict], png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # a repeat (name.2) and plain Megatron (the same step, the same losses) add no bar
    found = [r for r in found if "." not in r["run"].split("/")[1]
             and not r["run"].endswith("plain_megatron")]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.2))
    labels = [f"{r['run']}\n(profile: {r['profile_softmax']} softmax)" for r in found]
    x = range(len(found))
    w = 0.27
    for ax, unit, keys in ((ax_t, "step time (s)", ("measured_s", "profile_s", "catalog_s")),
                           (ax_m, "peak memory (GB)",
                            ("measured_gb", "profile_gb", "catalog_gb"))):
        for k, (key, name, color) in enumerate(zip(
                keys, ("measured (Megatron-LM)", "predicted with the profile",
                       "predicted from the catalog"), ("#333333", "#2a7ab9", "#c9a227"))):
            ax.bar([i + (k - 1) * w for i in x], [r[key] for r in found], w, label=name,
                   color=color)
        ax.set_xticks(list(x), labels, rotation=40, ha="right", fontsize=7)
        ax.set_ylabel(unit)
        ax.grid(axis="y", alpha=0.3)
    handles, names = ax_t.get_legend_handles_labels()
    fig.legend(handles, names, loc="upper right", ncol=3, fontsize=8)
    fig.suptitle("One H200, Llama-2 7B shapes cut to 8 layers, bf16, megatron-core local layers (runs 1-3: mbs 2, seq 4096, GBS 8)",
                 fontsize=10, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(png, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="*", type=Path,
                    default=sorted(p for p in (REPO / "docs" / "gpu").glob("run*") if p.is_dir()))
    ap.add_argument("--profile", type=Path,
                    help="predict every run from this profile (default: each run's own)")
    ap.add_argument("--png", type=Path, default=REPO / "docs" / "img" / "gpu-predicted.png")
    a = ap.parse_args()
    found = rows(a.runs, profile=a.profile)
    print(table(found))
    figure(found, a.png)
    print(f"wrote {a.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
