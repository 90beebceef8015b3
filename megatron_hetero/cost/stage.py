"""One pipeline stage: what its time and memory depend on (:class:`StageShape`), and what the
cost model says of it (:class:`StageTimes`, :class:`Memory`).

The cost model's time and memory functions take a :class:`StageShape`; the tuner builds shapes
for stage positions it has not planned yet, and :meth:`StageShape.of` reads one off a plan.
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass, field

from ..plan import Offload, Plan, Recompute
from ..schedule.rules import megatron_warmup

__all__ = ["StageShape", "StageTimes", "Memory"]


@dataclass(frozen=True, kw_only=True, slots=True)
class StageShape:
    """One (pipeline, stage) of a plan, or a stage position the tuner weighs: one tensor rank's
    device, layers, batch, parallel sizes, memory policy and place in the schedule. Frozen and
    hashable, so costs are cached by it."""

    device_type: str
    """Canonical catalog name of the GPU type that runs the stage."""
    chunk_layers: tuple[int, ...]
    """Layers of each model chunk (one entry when the plan does not interleave)."""
    micro_batch_size: int
    tensor_parallel_size: int = 1
    sequence_parallel: bool = False
    """Megatron's ``--sequence-parallel`` (only effective at TP > 1)."""
    recompute: Recompute = field(default_factory=Recompute)
    """The stage's recompute; an interleaved stage's chunks take theirs from it
    (:func:`~megatron_hetero.plan.chunk_recompute`)."""
    offload: Offload = field(default_factory=Offload)
    pipeline_size: int = 1
    stage: int = 0
    """Pipeline rank: stage 0 holds the embedding, stage ``pipeline_size - 1`` the output layer
    and loss."""
    num_microbatches: int = 1
    """Micro-batches of the stage's replica per step."""
    microbatch_group: int | None = None
    """The interleaved schedule's micro-batch group (None: Megatron's default, the pipeline
    size)."""
    data_parallel_size: int = 1
    """Replicas the stage's optimizer state is sharded over."""
    warmup_microbatches: int | None = None
    """Warm-up forwards of the stage (non-interleaved; None: Megatron's ``p - s - 1``)."""
    expert_parallel_size: int = 1
    """Ranks the stage's routed experts are sharded over (an MoE model's EP group)."""
    expert_tensor_parallel_size: int | None = None
    """Tensor ranks of one expert (None: ``tensor_parallel_size``, Megatron's default)."""
    alltoall_gb_s: float | None = None
    """GB/s of the slowest link the stage's EP group spans (None: the cost model's guess from
    the device type's nodes, :meth:`~megatron_hetero.cost.model.CostModel.expert_link_gb_s`)."""
    moe_layers: int | None = None
    """The MoE layers among the stage's layers, for a model that mixes MoE and dense layers
    (None: the model's share of them; the cost model prices a stage that has it as
    :func:`~megatron_hetero.models.mixed_model`)."""

    num_layers: int = field(init=False, compare=False, repr=False)
    """The stage's layers, all chunks together (derived)."""
    _hash: int = field(init=False, compare=False, repr=False)
    """The hash of the fields above, computed once: the cost model's caches and the tuner's
    memos look shapes up many times each."""

    def __post_init__(self) -> None:
        _derive(self, _values(self))

    def __hash__(self) -> int:
        return self._hash

    def __getstate__(self) -> tuple:
        return _values(self)

    def __setstate__(self, state: tuple) -> None:
        # a string's hash differs from process to process: a copy derives its own
        for setter, value in zip(_SETTERS, state):
            setter(self, value)
        _derive(self, state)

    def __eq__(self, other: object) -> bool:
        if other is self:
            return True
        if other.__class__ is not StageShape:
            return NotImplemented
        return self._hash == other._hash and _values(self) == _values(other)

    @classmethod
    def of(cls, plan: Plan, pipeline: int, stage: int) -> StageShape:
        """The shape of (pipeline, stage) of ``plan`` (one grid)."""
        return cls.at(plan, 0, stage, pipeline, global_stage=stage)

    @classmethod
    def at(cls, plan: Plan, mesh: int, stage: int, replica: int, *,
           global_stage: int | None = None) -> StageShape:
        """The shape of one tensor rank of (mesh, stage of the mesh, replica) of any plan: its
        mesh's TP and DP, its replica's batch, its stage's layers and policies."""
        m = plan.meshes[mesh]
        pipe = m.pipelines[replica]
        st = pipe.stages[stage]
        tp = m.tensor_model_parallel_size
        if global_stage is None:
            global_stage = sum(len(x.pipelines[0].stages) for x in plan.meshes[:mesh]) + stage
        return cls(device_type=st.device_type,
                   chunk_layers=tuple(st.chunk_layers) if st.chunk_layers else (st.num_layers,),
                   micro_batch_size=pipe.micro_batch_size, tensor_parallel_size=tp,
                   sequence_parallel=plan.sequence_parallel_in(mesh), recompute=st.recompute,
                   offload=st.offload, pipeline_size=plan.pipeline_model_parallel_size,
                   stage=global_stage, num_microbatches=pipe.num_microbatches,
                   microbatch_group=plan.microbatch_group_size,
                   data_parallel_size=len(m.pipelines),
                   warmup_microbatches=st.warmup_microbatches,
                   expert_parallel_size=m.expert_model_parallel_size,
                   expert_tensor_parallel_size=m.expert_tensor_parallel_size,
                   moe_layers=_moe_layers(plan, global_stage))

    def but(self, **changes) -> StageShape:
        """This shape with some fields changed (as :func:`dataclasses.replace`, checked the
        same way)."""
        values = list(_values(self))
        for name, value in changes.items():
            i = _INDEX.get(name)
            if i is None:
                raise TypeError(f"StageShape has no field {name!r}")
            values[i] = value
        new = object.__new__(StageShape)
        for set_field, value in zip(_SETTERS, values):
            set_field(new, value)
        _derive(new, tuple(values))
        return new

    @property
    def virtual_size(self) -> int:
        """Model chunks of the stage."""
        return len(self.chunk_layers)

    @property
    def first(self) -> bool:
        """Holds the embedding (on its first chunk)."""
        return self.stage == 0

    @property
    def last(self) -> bool:
        """Holds the output layer and the loss (on its last chunk)."""
        return self.stage == self.pipeline_size - 1

    @property
    def in_flight(self) -> int:
        """Micro-batches whose activations the stage holds at its 1F1B peak: its warm-up
        forwards and the one it runs before its first backward, at most all of them."""
        w = self.warmup_microbatches
        if w is None:
            w = megatron_warmup(self.pipeline_size, self.stage, self.num_microbatches)
        return min(w + 1, self.num_microbatches)

    @property
    def expert_shards(self) -> int:
        """Ranks one MoE layer's routed experts are split over: expert TP x EP."""
        etp = self.expert_tensor_parallel_size
        return (self.tensor_parallel_size if etp is None else etp) * self.expert_parallel_size

    @property
    def sp(self) -> bool:
        """Sequence parallelism in effect (the flag, at TP > 1)."""
        return self.sequence_parallel and self.tensor_parallel_size > 1


def _moe_layers(plan: Plan, global_stage: int) -> int | None:
    """The MoE layers of pipeline stage ``global_stage`` of ``plan`` (all its model chunks);
    None unless the model mixes MoE and dense layers."""
    m = plan.model
    if not m.is_moe or m.moe_layer_freq == 1:
        return None
    pattern = m.moe_layer_pattern
    if all(pattern):
        return None
    segments, p = plan.virtual_stage_layers, plan.pipeline_model_parallel_size
    starts = [0]
    for n in segments:
        starts.append(starts[-1] + n)
    return sum(sum(pattern[starts[i]:starts[i + 1]]) for i in range(global_stage, len(segments), p))


_FIELDS = tuple(f.name for f in dataclasses.fields(StageShape) if f.init)
_INDEX = {name: i for i, name in enumerate(_FIELDS)}
_values = operator.attrgetter(*_FIELDS)
"""A shape's fields, in order, as a tuple (what it is equal and hashed by)."""
_SETTERS = tuple(getattr(StageShape, name).__set__ for name in _FIELDS)
"""Each field's slot setter, in order (:meth:`StageShape.but` fills a new shape with them)."""
_set_num_layers = StageShape.num_layers.__set__
_set_hash = StageShape._hash.__set__


def _derive(shape: StageShape, values: tuple) -> None:
    """Check ``shape`` (whose fields are ``values``) and set its derived fields."""
    chunks = shape.chunk_layers
    if not chunks or min(chunks) < 0:
        raise ValueError(f"chunk layers {chunks}: one non-negative count per chunk")
    if not 0 <= shape.stage < shape.pipeline_size:
        raise ValueError(f"stage {shape.stage} of a pipeline of {shape.pipeline_size}")
    _set_num_layers(shape, sum(chunks))
    _set_hash(shape, hash(values))


@dataclass(frozen=True, slots=True)
class StageTimes:
    """Seconds of one micro-batch on one stage (compute plus tensor-parallel communication)."""

    forward_s: float
    backward_s: float
    """Includes the recompute forward when the stage recomputes."""

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s


@dataclass(frozen=True, slots=True)
class Memory:
    """Bytes one tensor rank of a stage needs at its peak, by kind, and what its device has."""

    params: float
    grads: float
    optimizer: float
    activations: float
    workspace: float
    capacity: float
    """Device memory a stage may use: what the card reports less the memory headroom
    (:meth:`~megatron_hetero.cost.model.CostModel.capacity`)."""

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.workspace

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    def to_dict(self) -> dict[str, float]:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "activations": self.activations, "workspace": self.workspace,
                "total": self.total, "capacity": self.capacity}
