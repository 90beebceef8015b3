"""Plan search: parallel sizes, mixed pipelines, layer split, micro-batch shares, recompute."""

from .problem import TuneOptions
from .search import TuneResult, tune
from .space import upper_bound_step_time

__all__ = ["TuneOptions", "TuneResult", "tune", "upper_bound_step_time"]
