"""Sizes beyond any real model or cluster, refused where they are read, with the limit named.

Without them a typo (``num_layers: 1000000``, ``nodes: 10^30``) sent the search into minutes of
work or a numpy allocation of terabytes before anything was said. Each limit is far above what
is built today (the deepest published LLMs have under 200 layers; the largest clusters about
200,000 GPUs; the GPUs' limit is lower, a partition of one: see :data:`MOST_GPUS`), and low
enough that the search stays within seconds and a few GB.
"""

from __future__ import annotations

from .errors import SchemaError

__all__ = ["MODEL_SIZES", "MOST_GPUS", "QUANTITIES", "quantity", "check_quantity",
           "check_model_size", "check_model_sizes", "check_gpus"]

MODEL_SIZES = {
    "num_layers": 512,
    "hidden_size": 1 << 17,
    "ffn_hidden_size": 1 << 19,
    "num_attention_heads": 1 << 12,
    "num_query_groups": 1 << 12,
    "vocab_size": 1 << 24,
    "seq_length": 1 << 25,
}
"""The most each model size may be; the search's tables grow with the square of the layers."""

MOST_GPUS = 1 << 17
"""The most GPUs an inventory may hold (131,072); the search grows with the GPUs. A model at
the layer limit (512) on a pool of this size is tuned in 13 CPU seconds; on 262,144 GPUs it
took 21 s and on 1,048,576 (the limit before issue 32) more than 27 s (killed after 400 s of a
loaded machine's wall clock): the larger pool of a real cluster is planned per partition."""


def check_model_size(key: str, value: int, *, source: str = "", path: str | None = None) -> int:
    """``value`` of the model size ``key`` is a positive integer within :data:`MODEL_SIZES`;
    the error names ``source`` and ``path`` (default: the field ``key``)."""
    most = MODEL_SIZES[key]
    if not 1 <= value <= most:
        raise SchemaError(source, key if path is None else path, value,
                          f"a positive integer of at most {most:,} (larger than any model this "
                          "tool can plan)")
    return value


def check_model_sizes(spec: object) -> None:
    """Each size of a :class:`~megatron_hetero.plan.ModelSpec` is within :data:`MODEL_SIZES`."""
    for key in MODEL_SIZES:
        check_model_size(key, getattr(spec, key))


def check_gpus(count: int, *, path: str, found: object) -> None:
    """``count`` GPUs (a group's, or an inventory's in all) are within :data:`MOST_GPUS`;
    ``path`` and ``found`` name the field the error points at."""
    if count > MOST_GPUS:
        raise SchemaError("", path, found, f"at most {MOST_GPUS:,} GPUs in all (found {count:,}; "
                                           "more than any cluster this tool can plan)")


QUANTITIES: dict[str, tuple[float, float, str]] = {
    "bandwidth_gb_s": (1e-6, 1e7, "a bandwidth in GB/s"),
    "tflops": (1e-6, 1e5, "a throughput in TFLOP/s"),
    "memory_gb": (1e-6, 1e6, "a memory size in GB"),
    "bytes": (1, 1e15, "a number of bytes"),
    "seconds": (1e-9, 1e5, "a measured time in seconds"),
    "latency_s": (1e-9, 10.0, "a latency in seconds"),
    "link_latency_s": (0.0, 10.0, "a link latency in seconds"),
    "time_scale": (1.0, 1e4, "a time scale"),
}
"""Each physical quantity a file or an option gives: the least and the most it may be, both
included, and what it is. The bounds lie far outside any device or link built (a bandwidth of
1 kB/s to 10 PB/s (the tests price links at round figures such as 1 PB/s), 1 MFLOP/s to 100 PFLOP/s a device, so that CPU ranks playing a GPU fit too), so that every figure the cost model
and the simulator derive stays a finite number of a bounded size: a bandwidth of 1e-300 GB/s
made transfers of 1e300 s and the search never ended; 1e299 TFLOP/s made times underflow to
zero and a division fail; ``--time-scale 1e308`` slept for ever. Zero and negative bytes,
latencies and bandwidths are below every bound: a measurement of them is a broken one."""


def quantity(kind: str) -> dict[str, str]:
    """Field metadata that makes :mod:`.._schema` check the field as the quantity ``kind`` of
    :data:`QUANTITIES` when a file gives it: ``field(metadata=quantity("bandwidth_gb_s"))``."""
    if kind not in QUANTITIES:
        raise KeyError(kind)
    return {"quantity": kind}


def check_quantity(kind: str, value: float, *, source: str = "", path: str = "") -> float:
    """``value`` within the bounds of the quantity ``kind``; else the one-line error naming
    ``source`` and ``path``."""
    low, high, what = QUANTITIES[kind]
    if not low <= value <= high:  # NaN fails too
        raise SchemaError(source, path, value, f"{what} from {low:,g} to {high:,g} (outside "
                                               "what any device or link does: a typo?)")
    return value

