"""Replace a Megatron function by a wrapper everywhere a module holds it by name."""

from __future__ import annotations

import importlib
import sys
from typing import Callable

__all__ = ["rebind", "is_wrapper"]

_MARK = "_megatron_hetero_wrapper"


def is_wrapper(obj) -> bool:
    return getattr(obj, _MARK, False)


def rebind(module_name: str, attr: str, make: Callable) -> None:
    """``module.attr = make(original)``, and the same in every loaded module whose global
    ``attr`` is the original (``from module import attr`` done before). Idempotent."""
    module = importlib.import_module(module_name)
    original = getattr(module, attr)
    if is_wrapper(original):
        return
    wrapper = make(original)
    setattr(wrapper, _MARK, True)
    for mod in list(sys.modules.values()):
        try:
            if mod is not None and mod.__dict__.get(attr) is original:
                setattr(mod, attr, wrapper)
        except (AttributeError, TypeError):
            continue
    if getattr(module, attr) is not wrapper:
        setattr(module, attr, wrapper)  # re-exported from elsewhere: bind it here too
