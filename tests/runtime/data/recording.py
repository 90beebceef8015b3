"""What a training script's rank read and computed, for the tests (nothing in the product knows
about it). With ``SAMPLES_LOG`` set, :func:`dump` writes ``$SAMPLES_LOG.<launcher rank>``: the
rank's Megatron rank, its (data-parallel, pipeline, tensor) ranks, ``[iteration, sample index]``
for every sample it read and ``[iteration, lm loss or None, grad norm]`` for every step as
``train_step`` returns them (Megatron's log rounds the norm to 3 decimals, and its second
logged step of a run averages the first two). ``iteration`` counts the steps done before, as
Megatron's ``args.curr_iteration``; the loss is on the last pipeline stage only.

With ``OFFLOAD_MIN_NUMEL`` set, :func:`record_offload` lowers megatron-core's size threshold of
fine-grained activation offloading (``TransformerConfig.min_offloaded_tensor_size``, 1M elements,
no command-line option) so that a tiny model's module inputs are offloaded, and records what
this rank offloaded: the bytes per module of megatron-core's offload summary, and the elements
of its optimizer shard that the CPU-offload optimizer keeps on the host and on the device.

Used by ``pretrain_gpt_recording.py`` (Megatron-LM's own ``pretrain_gpt.py``, mock data) and by
``train_tiny.py`` (the tests' own script, where no Megatron-LM clone is at hand)."""
import json
import os

READ = []
STEPS = []
RANKS = {}
OFFLOAD = {}


def _ranks() -> None:
    from megatron.core import parallel_state as ps

    if not RANKS and ps.model_parallel_is_initialized():
        RANKS.update(dp=ps.get_data_parallel_rank(), pp=ps.get_pipeline_model_parallel_rank(),
                     tp=ps.get_tensor_model_parallel_rank())


def read(idx) -> None:
    """Record that this rank read sample ``idx`` in the current step."""
    from megatron.training import get_args

    _ranks()
    READ.append([int(getattr(get_args(), "curr_iteration", -1)), int(idx)])


def record_steps() -> None:
    """Wrap ``megatron.training.training.train_step`` to record each step's loss and norm."""
    import megatron.training.training as training

    train_step = training.train_step

    def step(*a, **kw):
        result = train_step(*a, **kw)
        from megatron.training import get_args

        losses, norm = result[0], result[5]  # megatron-core 0.17.1: (loss dict, ..., grad norm, ...)
        loss = losses.get("lm loss") if losses else None
        STEPS.append([int(get_args().curr_iteration), None if loss is None else float(loss),
                      None if norm is None else float(norm)])
        return result

    training.train_step = step


def record_offload() -> None:
    """See the module docstring (nothing when ``OFFLOAD_MIN_NUMEL`` is unset)."""
    if not os.environ.get("OFFLOAD_MIN_NUMEL"):
        return
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer
    from megatron.core.pipeline_parallel import fine_grained_activation_offload as fgo
    from megatron.core.transformer.transformer_config import TransformerConfig

    post_init, summary = TransformerConfig.__post_init__, fgo.print_offload_summary_table
    init_sub = HybridDeviceOptimizer._init_sub_optimizers

    def __post_init__(self):
        post_init(self)
        self.min_offloaded_tensor_size = int(os.environ["OFFLOAD_MIN_NUMEL"])

    def print_offload_summary_table(total_offload_bytes):
        OFFLOAD["module_input_bytes"] = dict(total_offload_bytes)
        return summary(total_offload_bytes)

    def _init_sub_optimizers(self):
        init_sub(self)  # the last one built is the distributed optimizer's (or a reloaded one)
        OFFLOAD["optimizer_host_numel"] = sum(
            p.numel() for p in self.gpu_params_map_cpu_copy.values())
        OFFLOAD["optimizer_device_numel"] = sum(
            p.numel() for g in (self.gpu_optimizer.param_groups if self.gpu_optimizer else [])
            for p in g["params"])

    TransformerConfig.__post_init__ = __post_init__
    fgo.print_offload_summary_table = print_offload_summary_table
    HybridDeviceOptimizer._init_sub_optimizers = _init_sub_optimizers


def dump() -> None:
    """Write the records where ``SAMPLES_LOG`` says (nothing when it is unset)."""
    out = os.environ.get("SAMPLES_LOG")
    if out:
        _ranks()  # ranks that read no sample (train_tiny.py's later stages)
        launcher = os.environ.get("MEGATRON_HETERO_LAUNCHER_RANK", os.environ["RANK"])
        with open(f"{out}.{launcher}", "w") as f:
            json.dump({"rank": int(os.environ["RANK"]), **RANKS, "read": READ, "steps": STEPS,
                       "offload": OFFLOAD}, f)
