"""``rebind``: wrappers of different layers stack, the same layer is applied once. (The vendors'
``initialize_model_parallel`` wrapper was once skipped because the hooks' mesh wrapper was
already there, and no pipeline edge across vendors was staged through the host.)"""

from __future__ import annotations

import functools
import sys
import types

from megatron_hetero.mcore.rebind import is_wrapper, rebind


def _layer(tag: str, calls: list):
    def make(original):
        @functools.wraps(original)
        def wrapper(*a, **kw):
            calls.append(tag)
            return original(*a, **kw)
        return wrapper
    return make


def test_layers_stack_and_each_applies_once(monkeypatch):
    mod = types.ModuleType("fake_megatron_ps")
    mod.init = lambda: "done"
    user = types.ModuleType("fake_user")
    user.init = mod.init  # `from fake_megatron_ps import init`, done before
    monkeypatch.setitem(sys.modules, "fake_megatron_ps", mod)
    monkeypatch.setitem(sys.modules, "fake_user", user)
    calls: list = []
    rebind("fake_megatron_ps", "init", _layer("mesh", calls))
    rebind("fake_megatron_ps", "init", _layer("mesh-again", calls))  # the same (default) layer
    rebind("fake_megatron_ps", "init", _layer("vendors", calls), layer="vendors")
    rebind("fake_megatron_ps", "init", _layer("vendors-again", calls), layer="vendors")
    assert mod.init() == "done" and calls == ["vendors", "mesh"]
    assert user.init is mod.init
    assert is_wrapper(mod.init) and is_wrapper(mod.init, "vendors") and is_wrapper(mod.init, "hooks")
    assert not is_wrapper(mod.init, "cpu")
