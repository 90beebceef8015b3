"""Plan search: parallel sizes, mixed pipelines, layer split, micro-batch shares, recompute."""

from .search import TuneOptions, TuneResult, tune, upper_bound_step_time

__all__ = ["TuneOptions", "TuneResult", "tune", "upper_bound_step_time"]
