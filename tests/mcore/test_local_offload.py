"""megatron-core's fine-grained activation offloading without Transformer Engine: the one flag
its manager sets on TE's ``cpu_offload`` module gets a stand-in (mcore/local_offload.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")


def test_the_stand_in_replaces_only_a_missing_te_module(monkeypatch):
    from megatron.core.extensions import transformer_engine as te_extensions

    from megatron_hetero.mcore.local_offload import (
        TeCpuOffloadFlag, enable_local_module_input_offload, te_cpu_offload_module)

    monkeypatch.setattr(te_extensions, "cpu_offload", None)  # no TE, as on this machine
    assert isinstance(te_cpu_offload_module(), TeCpuOffloadFlag)
    enable_local_module_input_offload()
    flag = te_extensions.cpu_offload
    assert isinstance(flag, TeCpuOffloadFlag) and flag.CPUOffloadEnabled is False
    enable_local_module_input_offload()
    assert te_extensions.cpu_offload is flag  # idempotent
    real = object()  # where TE is installed, its own module stays
    monkeypatch.setattr(te_extensions, "cpu_offload", real)
    enable_local_module_input_offload()
    assert te_extensions.cpu_offload is real and te_cpu_offload_module() is real


def test_the_offload_manager_enters_its_context_with_the_stand_in(monkeypatch):
    # what raised "TE CPU offload is not available" on a GPU without TE
    from megatron.core.extensions import transformer_engine as te_extensions
    from megatron.core.pipeline_parallel import fine_grained_activation_offload as fgo

    from megatron_hetero.mcore.local_offload import enable_local_module_input_offload

    monkeypatch.setattr(te_extensions, "cpu_offload", None)
    enable_local_module_input_offload()
    manager = fgo.PipelineOffloadManager.__new__(fgo.PipelineOffloadManager)
    chunk = type("Chunk", (), {"do_offload": True})()
    manager._cur_forward_chunk = chunk
    manager.cur_forward_chunk = lambda: chunk
    manager.on_save_for_backward = lambda t: t
    manager.on_get_saved_tensor = lambda t: t
    # megatron-core 0.19's __init__ keeps the saved-tensor hooks' context (0.17 made it in __enter__)
    from torch.autograd.graph import saved_tensors_hooks
    manager._saved_tensors_hooks = saved_tensors_hooks(manager.on_save_for_backward,
                                                       manager.on_get_saved_tensor)
    manager.__enter__()
    try:
        assert te_extensions.cpu_offload.CPUOffloadEnabled is True
    finally:
        manager.__exit__(None, None, None)
    assert te_extensions.cpu_offload.CPUOffloadEnabled is False
