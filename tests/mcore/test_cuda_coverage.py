"""The CPU backend's redirect table pinned against the installed megatron-core's source (and
megatron-core 0.17.1's, the oldest supported)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.conftest import OLD_STACK, mcore_environ
from tests.mcore.cuda_coverage import (CPU_PATH_MODULES, cuda_uses, is_covered,
                                                 uncovered_cuda_uses)


def test_table_covers_every_cuda_use_of_installed_megatron_core():
    total = sum(len(cuda_uses(m)) for m in CPU_PATH_MODULES)
    assert total > 50  # the scan sees megatron-core's CUDA sites at all
    uncovered = uncovered_cuda_uses()
    assert uncovered == [], "CUDA uses the CPU backend does not cover:\n" + "\n".join(
        f"  megatron.core.{u.module}:{u.line} in {u.function or '<module>'}: {u.use}"
        for u in uncovered)


def test_interleaved_schedule_is_scanned_and_covered():
    """The interleaved (virtual pipeline) schedule's CUDA uses are on the scanned path and
    covered; its helper modules are scanned too."""
    assert {"pipeline_parallel.schedules", "pipeline_parallel.p2p_communication",
            "pipeline_parallel.utils", "transformer.pipeline_parallel_layer_layout"} <= set(
        CPU_PATH_MODULES)
    uses = [u for u in cuda_uses("pipeline_parallel.schedules")
            if u.function == "forward_backward_pipelining_with_interleaving"]
    assert uses and all(is_covered(u) for u in uses)
    p2p = [u for u in cuda_uses("pipeline_parallel.p2p_communication")
           if u.function.startswith("P2PCommunicator.")]
    assert p2p and all(is_covered(u) for u in p2p)


@pytest.mark.slow
def test_table_covers_megatron_core_017():
    script = ("import megatron.core; from tests.mcore.cuda_coverage import "
              "uncovered_cuda_uses as u; print(megatron.core.__version__, u())")
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", script],
                         env=mcore_environ(OLD_STACK), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "0.17.1 []"


def test_scan_flags_a_new_cuda_path():
    source = textwrap.dedent("""
        import torch
        def new_feature(x):
            torch.cuda.memory_reserved()          # a torch.cuda function not in the table
            if x.is_cuda:                          # a branch that differs on CPU
                pass
            torch.autocast("cuda")                 # a literal outside a device argument
            y = torch.zeros(1, device="cuda")      # mapped by the device mode
            torch.cuda.synchronize()               # redirected
            return x.to("cuda"), torch.device("cuda:0"), y, x.cuda()
    """)
    uses = cuda_uses("new_module", source=source)
    flagged = sorted(u.use for u in uses if not is_covered(u))
    assert flagged == [".is_cuda", "torch.autocast('cuda')", "torch.cuda.memory_reserved"]
    assert all(u.function == "new_feature" for u in uses)
    assert "Tensor.cuda" in {u.use for u in uses}
