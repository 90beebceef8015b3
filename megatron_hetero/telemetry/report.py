"""``megatron-hetero report DIR``: what a run's telemetry says about its plan.

The figures of each stage of each replica are the median over the reported steps (or those of
one ``--step``), measured beside predicted. A stage is *slow* when its measured compute over its
predicted compute exceeds the job's median of that ratio by more than ``threshold``: the ratio
against the rest of the job rather than against the prediction alone, so that a cost model that
is off for every card (catalog figures instead of a profile) flags no stage, and one card that
heats up, or a neighbour that shares it, stands out.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from ..errors import HeteroError
from .records import StageFigures, StageRecord, StepRecord

__all__ = ["StageSummary", "summarize", "slow_stages", "DEFAULT_THRESHOLD", "report_lines",
           "timelines_png"]

DEFAULT_THRESHOLD = 1.15
"""A stage is slow beyond this many times the job's median measured-over-predicted ratio."""

_KINDS = ("forward_s", "backward_s", "sync_s", "optimizer_s", "wait_s")


@dataclass(kw_only=True, slots=True)
class StageSummary:
    """One stage of one replica over the reported steps."""

    path: str
    replica: int
    stage: int
    device_type: str
    measured: StageFigures
    """Median of each figure over the steps."""
    predicted: StageFigures | None

    @property
    def ratio(self) -> float | None:
        """Measured over predicted compute; None without a prediction."""
        if self.predicted is None or self.predicted.compute_s <= 0:
            return None
        return self.measured.compute_s / self.predicted.compute_s


def _median_figures(figures: list[StageFigures]) -> StageFigures:
    return StageFigures(**{k: statistics.median(getattr(f, k) for f in figures) for k in _KINDS})


def pick(records: list[StepRecord], step: int | None) -> list[StepRecord]:
    """The records of ``step`` (all where None); an unreported step is an error naming those
    that were reported."""
    if step is None:
        return records
    chosen = [r for r in records if r.step == step]
    if not chosen:
        steps = [r.step for r in records]
        raise HeteroError(f"--step {step}: not a reported step; the telemetry has steps "
                          f"{steps[0]}..{steps[-1]} ({', '.join(map(str, steps[:12]))}"
                          f"{', ...' if len(steps) > 12 else ''})")
    return chosen[-1:]


def summarize(records: list[StepRecord]) -> list[StageSummary]:
    """Each stage of each replica, its figures the median over ``records``."""
    by: dict[tuple[int, int], list[StageRecord]] = {}
    for rec in records:
        for s in rec.stages:
            by.setdefault((s.replica, s.stage), []).append(s)
    out = []
    for (replica, stage), rows in sorted(by.items()):
        preds = [s.predicted for s in rows if s.predicted is not None]
        out.append(StageSummary(path=rows[-1].path, replica=replica, stage=stage,
                                device_type=rows[-1].device_type,
                                measured=_median_figures([s.measured for s in rows]),
                                predicted=_median_figures(preds) if preds else None))
    return out


def slow_stages(stages: list[StageSummary], *,
                threshold: float = DEFAULT_THRESHOLD) -> tuple[list[tuple[StageSummary, float]], float | None]:
    """The slow stages with their ratio over the job's median (slowest first), and that
    median (None where no stage has a prediction)."""
    ratios = [s.ratio for s in stages if s.ratio is not None]
    if not ratios:
        return [], None
    median = statistics.median(ratios)
    slow = [(s, s.ratio / median) for s in stages if s.ratio is not None
            and s.ratio / median > threshold]
    return sorted(slow, key=lambda x: -x[1]), median


def seconds_text(x: float) -> str:
    """``x`` seconds in three figures in the unit that needs no leading zeros (``12.3ms``)."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6), ("ns", 1e-9)):
        if abs(x) >= scale or unit == "ns":
            return f"{x / scale:.3g}{unit}"
    raise AssertionError("unreachable")


def _pair(measured: float, predicted: float | None) -> str:
    if predicted is None:
        return seconds_text(measured)
    return f"{seconds_text(measured)}\n[dim]{seconds_text(predicted)}[/]"


def report_lines(records: list[StepRecord], stages: list[StageSummary], *,
                 threshold: float, source: str):
    """The report: a rich table (per stage, measured / predicted seconds) and its lines."""
    from rich.table import Table

    steps = [r.step for r in records]
    table = Table(title=f"{source}: step{'s' if len(steps) > 1 else ''} "
                        f"{steps[0]}{'..' + str(steps[-1]) if len(steps) > 1 else ''} "
                        f"({'median of ' + str(len(steps)) if len(steps) > 1 else 'one step'}); "
                        "seconds per step, measured (predicted under it)")
    for col in ("stage", "r", "device", "forward", "backward", "sync", "optim.", "waits",
                "x"):
        table.add_column(col, justify="left" if col in ("stage", "device") else "right",
                         no_wrap=col in ("stage", "device"))
    for s in stages:
        p = s.predicted
        table.add_row(s.path, str(s.replica), s.device_type,
                      *(_pair(getattr(s.measured, k), None if p is None else getattr(p, k))
                        for k in _KINDS),
                      "-" if s.ratio is None else f"{s.ratio:.3g}")
    lines = []
    measured = statistics.median(r.step_time_s for r in records)
    predicted = [r.predicted_step_time_s for r in records if r.predicted_step_time_s]
    line = f"step time {seconds_text(measured)}"
    if predicted:
        pred = statistics.median(predicted)
        line += (f", predicted {seconds_text(pred)} ({measured / pred:.3g}x); prediction: "
                 f"{records[-1].prediction}")
    lines.append(line)
    slow, median = slow_stages(stages, threshold=threshold)
    if median is None:
        lines.append("no prediction in the telemetry: slow stages cannot be named")
    elif not slow:
        lines.append(f"no slow stage: none computes more than {threshold:g}x the job's median "
                     f"measured/predicted ratio ({median:.3g})")
    for s, over in slow:
        lines.append(f"slow: {s.path} replica {s.replica} ({s.device_type}): {s.ratio:.3g}x its "
                     f"prediction, {over:.2f}x the job's median ratio ({median:.3g})")
    return table, lines


def timelines_png(record: StepRecord, predicted_events, predicted_step_s: float | None, path) -> None:
    """The measured timeline of ``record`` (each stage's forwards and backwards) above the
    predicted one (the simulator's events of the same plan), each on its own time axis."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = [(s.replica, s.stage) for s in record.stages]
    label = {(s.replica, s.stage): f"{s.path} r{s.replica} {s.device_type}" for s in record.stages}
    colors = {"F": "#4C72B0", "B": "#55A868"}
    panels = 2 if predicted_events else 1
    fig, axes = plt.subplots(panels, 1, figsize=(12, panels * (0.45 * len(rows) + 1.2)),
                             squeeze=False)
    ax = axes[0][0]
    for i, s in enumerate(record.stages):
        for kind in "FB":
            spans = [(o.start_s, o.end_s - o.start_s) for o in s.ops or [] if o.kind == kind]
            ax.broken_barh(spans, (i - 0.4, 0.8), facecolors=colors[kind], edgecolor="white",
                           linewidth=0.2)
    ax.set_title(f"measured: step {record.step}, {record.step_time_s:.3f} s ({record.clock})")
    if panels == 2:
        ax2 = axes[1][0]
        index = {r: i for i, r in enumerate(rows)}
        for e in predicted_events:
            i = index.get((e.pipeline, e.stage))
            if i is not None and e.kind in colors:
                ax2.broken_barh([(e.start, e.end - e.start)], (i - 0.4, 0.8),
                                facecolors=colors[e.kind], edgecolor="white", linewidth=0.2)
        ax2.set_title(f"predicted: {predicted_step_s:.3f} s ({record.prediction})")
    for (a,) in axes:
        a.set_yticks(range(len(rows)))
        a.set_yticklabels([label[r] for r in rows], fontsize=7)
        a.invert_yaxis()
        a.set_xlabel("seconds from the start of the step")
    axes[0][0].legend(handles=[Patch(color=c, label=k) for k, c in colors.items()],
                      loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
