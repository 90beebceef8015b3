"""Stage tables built together (issue 18: the tables a structure needs first share one stack of
option grids, :mod:`megatron_hetero.tuner.grid`, and each menu is picked for the whole stack)
give what each table built alone gives, bit for bit, for every menu the search picks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from megatron_hetero._schema import read_yaml
from megatron_hetero.hardware import inventory_from_data
from megatron_hetero.models import load_model
from megatron_hetero.tuner.problem import Problem, TuneOptions
from megatron_hetero.tuner.space import structures
from megatron_hetero.tuner.tables import StageTables, stage_shape

SCENARIOS = Path(__file__).resolve().parents[2] / "examples" / "scenarios"
MENUS = ("fit", "rec", "base", "base_mi", "sel")


def _problem(scenario: str, gbs: int) -> Problem:
    data = read_yaml(SCENARIOS / f"{scenario}.yaml")
    inventory = inventory_from_data(data["inventory"], source="scenario")
    model = load_model(data["model"], seq_length=data.get("seq_length"))
    return Problem(model, inventory, gbs, {}, TuneOptions())


def _same(a, b) -> None:
    for field in ("index", "layers", "fraction", "seconds"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
    assert (a.kinds, a.fitting, a.chosen) == (b.kinds, b.fitting, b.chosen)


@pytest.mark.parametrize("scenario, gbs", [("a100-v100-llama2-7b", 128),  # unfused V100
                                           ("a800-a40-llama2-70b", 16384),
                                           ("h100-a100-llama2-13b", 10**6)])
def test_tables_built_together_are_those_built_alone(scenario, gbs):
    problem = _problem(scenario, gbs)
    together = StageTables(problem)
    tables = 0
    # every 15th of the structures in the walk's order: deep, interleaved and mixed ones
    for _, st in structures(problem)[:1500:15]:
        prec = problem.precision_for({t for types, _ in st.templates for t in types})
        rows = together.for_structure(st, prec)
        # the menus asked in turns, as the tuned and the baseline walks ask them
        for name in MENUS:
            for row in rows:
                for tb in row:
                    getattr(tb, name)
        m = st.pp * max(1, -(-(gbs // st.mbs) // (st.num_pipelines * st.pp)))
        for (types, _), row in zip(st.templates, rows):
            for s, tb in enumerate(row):
                alone = StageTables(problem).table(stage_shape(st, types, s, microbatches=m),
                                                   precision=prec)
                for name in MENUS:
                    _same(getattr(tb, name), getattr(alone, name))
                np.testing.assert_array_equal(tb.t_sel, alone.t_sel)
                np.testing.assert_array_equal(tb.t_none, alone.t_none)
                tables += 1
    assert tables > 100
