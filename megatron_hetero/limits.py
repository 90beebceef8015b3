"""Sizes beyond any real model or cluster, refused where they are read, with the limit named.

Without them a typo (``num_layers: 1000000``, ``nodes: 10^30``) sent the search into minutes of
work or a numpy allocation of terabytes before anything was said. Each limit is far above what
is built today (the deepest published LLMs have under 200 layers; the largest clusters about
200,000 GPUs), and low enough that the search stays within seconds and a few GB.
"""

from __future__ import annotations

from .errors import SchemaError

__all__ = ["MODEL_SIZES", "MOST_GPUS", "check_model_size", "check_model_sizes", "check_gpus"]

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

MOST_GPUS = 1 << 20
"""The most GPUs an inventory may hold (1,048,576); placement grows with the GPUs."""


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
