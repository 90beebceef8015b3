"""megatron-hetero: plan and run Megatron-LM training on a mixed pool of GPUs.

The tuner side (plans, inventories, cost model, search) is pure Python and never imports torch.
The names below are imported on first use (PEP 562), so that the ``megatron-hetero`` command
starts without loading them, its Ctrl-C handling first (:mod:`megatron_hetero.interrupts`).
"""

from __future__ import annotations

from . import interrupts

if interrupts.is_cli():
    interrupts.defer()  # the first thing the CLI does: a Ctrl-C from here on is one line

import importlib  # noqa: E402

from ._version import __version__  # noqa: E402

__all__ = ["__version__", "HeteroError", "InfeasibleError", "SchemaError", "Catalog", "GPUSpec",
           "Inventory", "load_catalog", "load_inventory", "megatron_args", "megatron_args_line",
           "Plan", "load_plan", "save_plan"]

_HOME = {"HeteroError": ".errors", "InfeasibleError": ".errors", "SchemaError": ".errors",
         "Catalog": ".hardware", "GPUSpec": ".hardware", "Inventory": ".hardware",
         "load_catalog": ".hardware", "load_inventory": ".hardware",
         "megatron_args": ".megatron_args", "megatron_args_line": ".megatron_args",
         "Plan": ".plan", "load_plan": ".plan", "save_plan": ".plan"}
"""Where each public name lives."""


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOME[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
