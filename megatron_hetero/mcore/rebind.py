"""Replace a Megatron function by a wrapper everywhere a module holds it by name."""

from __future__ import annotations

import importlib
import sys
from typing import Callable

__all__ = ["rebind", "is_wrapper", "mark_wrapper"]

_MARK = "_megatron_hetero_wrapper"


def _layers(obj) -> frozenset:
    """The layers of our wrappers ``obj`` is (``functools.wraps`` copies the mark from the
    function it wraps, so a wrapper of a wrapper holds both)."""
    mark = getattr(obj, _MARK, None)
    return mark if isinstance(mark, frozenset) else frozenset()


def is_wrapper(obj, layer: str | None = None) -> bool:
    """Whether ``obj`` is one of our wrappers (of ``layer``, where given)."""
    got = _layers(obj)
    return layer in got if layer is not None else bool(got)


def mark_wrapper(wrapper, original, layer: str) -> None:
    """Mark ``wrapper`` of ``original`` as ``layer``'s, beside the layers ``original`` has."""
    setattr(wrapper, _MARK, _layers(original) | {layer})


def rebind(module_name: str, attr: str, make: Callable, *, layer: str = "hooks") -> None:
    """``module.attr = make(original)``, and the same in every loaded module whose global
    ``attr`` is the original (``from module import attr`` done before). Idempotent per
    ``layer``: a function already wrapped by ``layer`` is left alone, and a wrapper of another
    layer (the hooks' mesh wrapper of ``initialize_model_parallel`` under the vendors' one) gets
    this layer's on top."""
    module = importlib.import_module(module_name)
    original = getattr(module, attr)
    if is_wrapper(original, layer):
        return
    wrapper = make(original)
    mark_wrapper(wrapper, original, layer)
    for mod in list(sys.modules.values()):
        try:
            if mod is not None and mod.__dict__.get(attr) is original:
                setattr(mod, attr, wrapper)
        except (AttributeError, TypeError):
            continue
    if getattr(module, attr) is not wrapper:
        setattr(module, attr, wrapper)  # re-exported from elsewhere: bind it here too
