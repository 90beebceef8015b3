"""Prediction of the emulated cluster: the tuner's cost model and simulator, over an inventory
whose GPU types are the emulated devices (the CPU's calibrated speed over each device's factor,
linked by gloo as measured)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..plan import Mesh, Plan
from .calibration import Calibration

__all__ = ["EmulatedProfile", "emulated_name", "emulated_cluster", "emulated_plan", "emulated_cost",
           "emulated_sends", "predict", "trainer_shards_optimizer"]


@dataclass(kw_only=True, slots=True)
class EmulatedProfile:
    """A :class:`~megatron_hetero.cost.profile_protocol.DeviceProfile` of one emulated device:
    the CPU's calibrated times stretched by the device's factor."""

    device_type: str
    factor: float
    calibration: Calibration
    efficiency: float | None = None

    def times(self, part, *, model, micro_batch_size, tensor_parallel_size):
        got = self.calibration.parts.get((part, micro_batch_size))
        if got is None:
            return None
        return (got[0] * self.factor / tensor_parallel_size,
                got[1] * self.factor / tensor_parallel_size)

    def pipeline_overhead(self, *, model, micro_batch_size, tensor_parallel_size):
        got = self.calibration.pipeline_overhead.get(micro_batch_size)
        if got is None:
            return None
        return (max(0.0, got[0]) * self.factor, max(0.0, got[1]) * self.factor)

    def step_overhead(self, *, model, micro_batch_size, tensor_parallel_size):
        got = self.calibration.step_overhead.get(micro_batch_size)
        if got is None:
            return None
        return (max(0.0, got[0]) * self.factor, max(0.0, got[1]) * self.factor)


def trainer_shards_optimizer(plan: Plan) -> bool:
    """Whether the mini trainer runs ``plan`` with Megatron's distributed optimizer (the CPU
    ranks then shard the optimizer state; the prediction and the caps must know)."""
    from .trainer import TrainConfig

    if "use_distributed_optimizer" not in TrainConfig.__dataclass_fields__:
        return False  # a trainer that always runs the plain optimizer
    return TrainConfig().distributed_optimizer(plan)  # the rehearsal keeps the trainer's default


def emulated_name(device_type: str) -> str:
    return f"CPU-as-{device_type}"


def _per_device(calibration, devices, factors: dict[str, float]) -> tuple[dict, Calibration]:
    """(device -> Calibration, the fastest device's) from one Calibration for all devices or a
    mapping with one per device type (each timed with that device's idle gaps)."""
    if isinstance(calibration, Calibration):
        per = {d: calibration for d in devices}
    else:
        per = {d: calibration[d] for d in devices}
    fastest = min(per, key=lambda d: (factors[d], d))
    return per, per[fastest]


def emulated_cluster(device_counts: dict[str, int], calibration,
                     factors: dict[str, float], *, gpus_per_node: int | None = None):
    """(inventory, profiles, cost-model options) of the emulated cluster: one GPU type
    ``CPU-as-<device>`` per device type, at the calibrated CPU speed over the device's factor,
    linked by gloo as measured (all-reduce bandwidth; point-to-point latency), optimizer steps at
    the measured rate; ``device_counts`` GPUs of each, ``gpus_per_node`` to a node (all in one
    node by default; 1 keeps a search from using tensor parallelism). The optimizer step and
    the gradient sync are not stretched: the ranks run them at CPU speed. ``calibration``: one
    :class:`Calibration`, or one per device type (its compute figures are that device's; links
    and the optimizer's rate are the fastest device's)."""
    from ..hardware.inventory import inventory_from_data

    per_device, calibration = _per_device(calibration, device_counts, factors)
    bw = calibration.allreduce_gb_s
    memory_bandwidth_gb_s = calibration.optimizer_gb_s
    gpus, groups = {}, []
    for device, count in sorted(device_counts.items()):
        name = emulated_name(device)
        flops = per_device[device].layer_flops_per_s / factors[device] / 1e12
        gpus[name] = {"vendor": "CPU", "bf16_tflops": flops, "bf16": True, "fp32_tflops": flops,
                      "memory_gb": 1e3, "memory_bandwidth_gb_s": memory_bandwidth_gb_s,
                      "intra_node_link": "gloo", "intra_node_bandwidth_gb_s": bw,
                      "efficiency": 1.0}
        per = min(gpus_per_node or count, count)
        groups.append({"gpu": name, "nodes": -(-count // per), "gpus_per_node": per,
                       "inter_node_bandwidth_gb_s": bw})
    inventory = inventory_from_data({"groups": groups, "gpus": gpus,
                                     "inter_group_bandwidth_gb_s": bw},
                                    source="<emulated cluster>")
    profiles = {emulated_name(d): EmulatedProfile(device_type=emulated_name(d), factor=f,
                                                   calibration=per_device[d])
                for d, f in factors.items() if d in device_counts}
    options = {"flash_attention": False, "workspace_gb": 0.0,
               "p2p_latency_s": calibration.p2p_latency_s}
    return inventory, profiles, options


def emulated_plan(shrunk: Plan, catalog) -> Plan:
    """``shrunk`` as the CPU ranks run it (fp32) on the emulated cluster: every stage's device
    type its emulated one (:func:`emulated_name`, in ``catalog``)."""
    def relabel(pipe):
        return dataclasses.replace(pipe, stages=[
            dataclasses.replace(st, device_type=emulated_name(st.device_type))
            for st in pipe.stages])

    meshes = [Mesh(tensor_model_parallel_size=m.tensor_model_parallel_size,
                   pipelines=[relabel(p) for p in m.pipelines]) for m in shrunk.meshes]
    return dataclasses.replace(shrunk, meshes=meshes, precision="fp32", prediction=None,
                               catalog=catalog)


def emulated_cost(shrunk: Plan, calibration, factors: dict[str, float]):
    """(``shrunk`` relabelled onto the emulated cluster, the tuner's cost model of that
    cluster): what :func:`predict` simulates."""
    from ..cost.model import CostModel

    inventory, profiles, options = emulated_cluster(dict(shrunk.device_counts()), calibration,
                                                    factors)
    emu = emulated_plan(shrunk, inventory.catalog)
    return emu, CostModel(emu.model, inventory, profiles=profiles, precision="fp32",
                          use_distributed_optimizer=trainer_shards_optimizer(shrunk), **options)


def predict(shrunk: Plan, calibration, factors: dict[str, float], *, links=None):
    """The tuner's cost model and simulator on the emulated cluster (:func:`emulated_cluster`)
    for ``shrunk`` (any shape) as the CPU ranks run it (fp32); ``calibration``: one
    :class:`Calibration` or one per device type; ``links``: the rehearsal's emulated link table
    (:func:`.links.rehearsal_links`, one grid), whose sends then take the place of gloo's
    (:func:`emulated_sends`). Returns a ``SimResult``."""
    from ..sim.step import simulate

    emu, cost = emulated_cost(shrunk, calibration, factors)
    if links is None:
        return simulate(emu, cost, record_events=False)
    return simulate(emu, cost, record_events=False,
                    pipeline_sends=emulated_sends(emu, cost, links))


def emulated_sends(emu: Plan, cost, links) -> dict[int, list[float]]:
    """Per pipeline, the seconds of one send over each of its links under the rehearsal's link
    emulation: the emulated link's time for the shrunk message (fp32 ``[s, b, h]`` per tensor
    rank), or gloo's where that is longer (the data still crosses gloo meanwhile)."""
    from ..plan import Slot

    p, tp, sp = (emu.pipeline_model_parallel_size, emu.tensor_model_parallel_size,
                 emu.sequence_parallel)
    pairs = [(s, s + 1) for s in range(p - 1)]
    if emu.virtual_pipeline_size > 1:
        pairs.append((p - 1, 0))
    out = {}
    for d, pipe in enumerate(emu.pipelines):
        b = pipe.micro_batch_size
        nbytes = 4.0 * b * emu.model.seq_length * emu.model.hidden_size  # as rehearsal_links
        gloo = cost.p2p_seconds(b, cost.inventory.intra_node_bandwidth(0), tp=tp, sp=sp)
        row = []
        for a, c in pairs:
            ra = emu.rank_of_slot(Slot(mesh=0, stage=a, replica=d, tensor_rank=0))
            rc = emu.rank_of_slot(Slot(mesh=0, stage=c, replica=d, tensor_rank=0))
            link = links.get((ra, rc))
            row.append(gloo if link is None else max(gloo, link.seconds(nbytes)))
        out[d] = row
    return out
