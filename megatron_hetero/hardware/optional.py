"""Detection of optional accelerators' libraries. Nothing here imports them eagerly."""

from __future__ import annotations

import importlib.util
from functools import cache

__all__ = ["have_transformer_engine", "have_apex", "have_megatron_core", "have_torch"]


def _present(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


@cache
def have_transformer_engine() -> bool:
    """Transformer Engine (extra ``te``) is installed."""
    return _present("transformer_engine")


@cache
def have_apex() -> bool:
    """NVIDIA Apex is installed (a source install: it is not on PyPI, whose ``apex`` is another
    project)."""
    return _present("apex")


@cache
def have_megatron_core() -> bool:
    return _present("megatron.core")


@cache
def have_torch() -> bool:
    return _present("torch")
