"""Fixtures of the launch tests: reference runs that several tests compare against, launched once
per session."""

from __future__ import annotations

import copy
import json

import pytest

from megatron_hetero.plan import Plan, save_plan

from .launching import launch


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory):
    """``reference_run(nproc, plan, **launch_kwargs) -> (results, workdir)``: ``launch`` of
    ``plan`` on ``nproc`` ranks, run once per session for every test that asks for the same
    ranks, plan and arguments (``timeout`` aside); each gets its own copy of the results.
    ``{work}`` in an ``extra`` argument is the run's own folder (a checkpoint there)."""
    done = {}

    def run(nproc: int, plan: Plan, *, iters: int = 2, timeout: float = 400, **kwargs):
        key = json.dumps([nproc, plan.to_data(), iters, kwargs], sort_keys=True, default=str)
        if key not in done:
            work = tmp_path_factory.mktemp("reference")
            save_plan(plan, work / "plan.yaml")
            extra = [a.format(work=work) for a in kwargs.pop("extra", ())]
            done[key] = (launch(nproc, str(work / "plan.yaml"), work, iters=iters, extra=extra,
                                timeout=timeout, **kwargs), work)
        return copy.deepcopy(done[key])

    return run
