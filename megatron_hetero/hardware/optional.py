"""Detection of optional accelerators' libraries. Nothing here imports them eagerly."""

from __future__ import annotations

import importlib.util
from functools import cache
from pathlib import Path

__all__ = ["have_transformer_engine", "have_apex", "have_megatron_core", "have_torch",
           "megatron_training_option"]


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


@cache
def megatron_training_option(dest: str) -> bool:
    """Whether the installed Megatron-LM's ``megatron.training`` knows the option whose
    ``args`` attribute is ``dest`` (``dist_ckpt_optim_fully_reshardable``), read from its source
    as text: nothing is imported (``args`` runs without torch)."""
    try:
        spec = importlib.util.find_spec("megatron")
    except (ImportError, ValueError):
        return False
    for root in (spec.submodule_search_locations or ()) if spec else ():
        folder = Path(root) / "training"
        for path in (folder / "arguments.py", *sorted((folder / "config").glob("*.py"))):
            if path.is_file() and dest in path.read_text(encoding="utf-8", errors="replace"):
                return True
    return False
