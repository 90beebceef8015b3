"""What one search is asked: the model, the inventory, the global batch, the knobs
(:class:`TuneOptions`), and the cost models of its precisions.

Every plan is bf16 where all its GPUs support it, else fp16, unless the options fix a
precision (:meth:`Problem.precision_for`);
each precision gets one :class:`~megatron_hetero.cost.model.CostModel`, built on first use and
shared by the search space's lower bounds, the stage tables and the simulator.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Mapping

from ..cost.model import DEFAULT_MEMORY_HEADROOM, CostModel
from ..cost.profile_protocol import DeviceProfile
from ..hardware.inventory import Inventory
from ..plan import ModelSpec
from ..plan.checks import optimizer_offload_runs

__all__ = ["TuneOptions", "Problem"]


@dataclass(kw_only=True, slots=True)
class TuneOptions:
    """Knobs of the search."""

    micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    """Micro-batch sizes tried (those dividing the global batch)."""
    tensor_parallel_sizes: tuple[int, ...] | None = None
    """Tensor-parallel sizes tried (None: every size that divides the heads and fits a node)."""
    max_pipeline_stages: int = 64
    max_virtual_pipeline_size: int = 4
    """Model chunks per stage tried: 1 (plain 1F1B) up to this (interleaved 1F1B), where every
    chunk gets a layer and the micro-batches form whole groups of the pipeline size (or of a
    micro-batch group up to twice it: :func:`~megatron_hetero.schedule.rules.whole_group`). The
    baseline (plain Megatron) tries every chunk count its even split allows, more than this
    too, so that a cap here never makes the baseline look slower than plain Megatron can be."""
    optimizer_offload: bool = True
    """Let stages offload optimizer state to the host where memory is short (else recompute only;
    never in fp32, where megatron-core's CPU-offload optimizer does not run:
    :func:`~megatron_hetero.plan.checks.optimizer_offload_runs`)."""
    activation_offload: bool = True
    """Let stages offload their layers' module inputs to the host where memory is short
    (megatron-core's fine-grained activation offloading; needs megatron-core 0.17 or later
    at run time, with Transformer Engine's layers or the local ones)."""
    overlap_grad_reduce: bool = True
    """Plans (the baseline's too: plain Megatron has the flag) overlap the data-parallel
    gradient reduction with the last backward (``--overlap-grad-reduce``)."""
    finalists: int = 4
    """Best estimates that are simulated before picking the plan."""
    refine_rounds: int = 8
    """Rounds of each hill climb of the local search on the simulator around the best plan
    (:mod:`.refine`; 0: no local search). Each round simulates every neighbouring layout and
    keeps the best."""
    per_stage_warmup: bool = True
    """Give the tuned plan's stages their own 1F1B warm-up where that is faster and fits
    (:mod:`.warmup`, the heterogeneity-aware 1F1B; non-interleaved plans)."""
    refine_max_virtual_pipeline_size: int = 8
    """Most model chunks per stage the local search moves to (at least
    ``max_virtual_pipeline_size``; none when that is 1). It tries only each stage's even
    spread per chunk count, so it affords more chunks than the structured search."""
    refine_restart_margin: float = 0.02
    """The local search climbs again from every other order of the plan's runs of one device
    type along the pipeline whose best start is at most this much slower than the best plan
    so far."""
    meshes: bool = False
    """Search mesh plans too (:mod:`.meshes`: each device type of a mixed pool its own TP and
    DP); one wins where it is strictly faster than the best uniform-TP plan. Off by default:
    the runtime runs mesh plans from megatron-core 0.17 (docs/meshes.md)."""
    mesh_chunks: bool = False
    """With ``meshes``: search mesh plans whose stages run model chunks too (interleaved 1F1B
    across meshes, :mod:`.meshes`). ``rehearse``, the CPU trainer and Megatron-LM's training
    run such a plan wherever mesh plans run; off by default (``tune --mesh-chunks``): it costs
    search time and wins on few pools (docs/meshes.md)."""
    precision: str | None = None
    """Train every plan in this precision (``bf16``, ``fp16``, ``fp32``); None: bf16 where all
    the plan's GPUs support it, else fp16. ``replan`` keeps the checkpoint's."""
    use_distributed_optimizer: bool = True
    """Plans shard optimizer state over data parallelism (``--use-distributed-optimizer``);
    ``replan`` keeps the checkpoint's choice."""
    memory_headroom: float = DEFAULT_MEMORY_HEADROOM
    """Fraction of each card's reported memory no stage's predicted peak may use
    (``--memory-headroom``; :meth:`~megatron_hetero.cost.model.CostModel.capacity`)."""
    progress: bool = False
    """Show a progress bar (rich) while structures are evaluated."""
    cost_options: dict = field(default_factory=dict)
    """Extra keyword arguments of :class:`CostModel` (flash_attention, workspace_gb, ...)."""


class Problem:
    """The inputs of one search, with its device types in search order and a cost model per
    precision (both cached)."""

    def __init__(self, model: ModelSpec, inventory: Inventory, global_batch_size: int,
                 profiles: Mapping[str, DeviceProfile], options: TuneOptions):
        if options.optimizer_offload and not optimizer_offload_runs(options.precision or "bf16"):
            options = dataclasses.replace(options, optimizer_offload=False)
        self.model, self.inv, self.gbs, self.opt = model, inventory, global_batch_size, options
        self.profiles = profiles
        self._costs: dict[str, CostModel] = {}
        self._precisions: dict[frozenset, str] = {}
        counts = inventory.gpu_counts()
        spec = inventory.spec
        # memory-rich first, then faster, then by name
        self.types = sorted(counts, key=lambda g: (-spec(g).memory_gb, -spec(g).bf16_tflops, g))

    def cost(self, precision: str) -> CostModel:
        if precision not in self._costs:
            self._costs[precision] = CostModel(
                self.model, self.inv, profiles=self.profiles, precision=precision,
                use_distributed_optimizer=self.opt.use_distributed_optimizer,
                memory_headroom=self.opt.memory_headroom, **self.opt.cost_options)
        return self._costs[precision]

    def precision_for(self, types) -> str:
        """The options' precision; else bf16 when every type in ``types`` supports it, else
        fp16."""
        if self.opt.precision is not None:
            return self.opt.precision
        key = frozenset(types)
        got = self._precisions.get(key)
        if got is None:
            got = self._precisions[key] = (
                "bf16" if all(self.inv.spec(t).bf16 for t in sorted(key)) else "fp16")
        return got
