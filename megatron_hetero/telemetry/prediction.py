"""The predicted side of the telemetry: what the plan's own cost model and simulator say each
stage of each replica spends in one step, by the same kinds of work the runtime measures
(:class:`~.records.StageFigures`).

The simulator needs the pool's links. A run that gives its inventory (``--hetero-inventory``)
is predicted on it, as ``tune`` and ``simulate`` would; without one the plan's device types
are laid out as the plan implies: each device type its own group of nodes of up to 8 GPUs,
with the catalog's links (the prediction says which it used).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..cost.model import CostModel
from ..cost.stage import StageShape
from ..hardware.inventory import Inventory, inventory_from_data
from ..plan import Plan
from ..sim.step import simulate
from .records import StageFigures

__all__ = ["Prediction", "predict", "implied_inventory", "stage_path", "stage_names",
           "plan_cost_model", "prediction_of"]

NODE_GPUS = 8
"""GPUs per node of the implied inventory."""


def stage_path(plan: Plan, *, mesh: int, stage: int, replica: int) -> str:
    """The plan path of one stage of one replica, as the plan's file names it:
    ``pipelines[r].stages[s]`` for a one-grid plan, ``meshes[k].stages[j]`` for a chain of
    meshes (whose replica the record gives beside it)."""
    if plan.one_grid:
        return f"pipelines[{replica}].stages[{stage}]"
    return f"meshes[{mesh}].stages[{stage}]"


def stage_names(plan: Plan) -> dict[str, tuple[int, int, int]]:
    """Every stage of every replica by the names a user may give it -> (mesh, stage in the
    mesh, replica): its telemetry path (:func:`stage_path`) where that names one replica's
    stage (one grid, or a mesh of one replica), and ``meshes[k].replicas[r].stages[j]``
    (format 2's words) always."""
    out = {}
    for k, mesh in enumerate(plan.meshes):
        for r in range(mesh.data_parallel_size):
            for j in range(mesh.num_stages):
                if plan.one_grid or mesh.data_parallel_size == 1:
                    out[stage_path(plan, mesh=k, stage=j, replica=r)] = (k, j, r)
                out[f"meshes[{k}].replicas[{r}].stages[{j}]"] = (k, j, r)
    return out


def implied_inventory(plan: Plan) -> Inventory:
    """An inventory that holds exactly the plan's GPUs: each device type its own group, in
    nodes of up to :data:`NODE_GPUS`, linked as the catalog says."""
    groups = []
    for gpu, count in sorted(plan.device_counts().items()):
        per = min(NODE_GPUS, count)
        groups.append({"gpu": gpu, "nodes": -(-count // per), "gpus_per_node": per})
    return inventory_from_data({"groups": groups}, source="<inventory implied by the plan>")


def plan_cost_model(plan: Plan, inventory: Inventory, *,
                    flash_attention: bool | None = None) -> CostModel:
    """The cost model that prices ``plan`` as it runs: its precision, optimizer and gradient
    overlap, on ``inventory`` (the telemetry's prediction, its profiles and report's timeline)."""
    return CostModel(plan.model, inventory, precision=plan.precision,
                     use_distributed_optimizer=plan.use_distributed_optimizer,
                     overlap_grad_reduce=plan.overlap_grad_reduce, flash_attention=flash_attention)


@dataclass(kw_only=True, slots=True)
class Prediction:
    """The plan's predicted step, per stage of each replica."""

    step_time_s: float | None
    """None where nothing could be predicted."""
    stages: dict[tuple[int, int], StageFigures]
    """(replica, stage along the whole pipeline) -> its predicted figures."""
    source: str
    """What the prediction used: the inventory file, or the implied one."""
    inventory: Inventory | None = None
    """The inventory it was made on."""


def predict(plan: Plan, inventory: Inventory | None = None, *, source: str | None = None,
            flash_attention: bool | None = None) -> Prediction:
    """The plan's prediction on ``inventory`` (default :func:`implied_inventory`); ``source``
    names the inventory in the records; ``flash_attention``: False where the run's layers are
    megatron-core's local ones (:class:`~megatron_hetero.cost.model.CostModel`)."""
    if inventory is None:
        inventory = implied_inventory(plan)
        source = "catalog figures, one group per device type (no --hetero-inventory)"
    cost = plan_cost_model(plan, inventory, flash_attention=flash_attention)
    return prediction_of(plan, cost, simulate(plan, cost, record_events=False),
                         source=source or inventory.source, inventory=inventory)


def prediction_of(plan: Plan, cost: CostModel, sim, *, source: str,
                  inventory: Inventory | None) -> Prediction:
    """The telemetry's figures of ``sim`` (the simulator's step of ``plan`` priced by
    ``cost``), per stage of each replica."""
    index = plan.stage_index
    stages = {}
    for s in sim.stages:
        k, j = index[s.stage]
        shape = StageShape.at(plan, k, j, s.pipeline)
        m = shape.num_microbatches
        opt = min(cost.optimizer_seconds(shape), s.sync_s)
        stages[(s.pipeline, s.stage)] = StageFigures(
            forward_s=s.forward_s * m, backward_s=s.backward_s * m, sync_s=s.sync_s - opt,
            optimizer_s=opt, wait_s=max(0.0, sim.step_time_s - s.busy_s - s.sync_s))
    return Prediction(step_time_s=sim.step_time_s, stages=stages, source=source,
                      inventory=inventory)
