"""Our wrappers of Megatron's functions and methods, each applied once per layer.

:func:`rebind` replaces a module function everywhere a module holds it by name;
:func:`wrap_method` replaces a class's method; :func:`skipped` is a ``make`` for either that
leaves a GPU-only step out on CPU ranks. A wrapper is marked with its layer (``hooks``,
``vendors``, ``cpu``): wrappers of different layers stack, the same layer is applied once.
"""

from __future__ import annotations

import functools
import importlib
import sys
from typing import Callable

__all__ = ["rebind", "wrap_method", "skipped", "is_wrapper", "mark_wrapper"]

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


def wrap_method(cls, name: str, make: Callable, *, layer: str,
                as_classmethod: bool = False) -> None:
    """``cls.name = make(original)`` (a ``classmethod`` of it with ``as_classmethod``, where
    ``make`` is given the bound original), once per ``layer``; nothing where ``cls`` has no
    ``name``."""
    original = getattr(cls, name, None)
    if original is None or is_wrapper(original, layer):
        return
    wrapper = make(original)
    mark_wrapper(wrapper, original, layer)
    setattr(cls, name, classmethod(wrapper) if as_classmethod else wrapper)


def skipped(original: Callable) -> Callable:
    """A stand-in for ``original`` that does nothing and returns None."""
    @functools.wraps(original)
    def skip(*a, **kw):
        return None
    return skip
