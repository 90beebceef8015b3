"""megatron-core on megatron-hetero's terms: its objects built from a plan or a ``ModelSpec``,
and megatron-core run on CPU processes.

- :mod:`.config`: ``TransformerConfig`` of a model (:func:`~.config.transformer_config`) and of
  one model chunk of a plan's stage as the CPU trainer runs it
  (:func:`~.config.plan_transformer_config`).
- :mod:`.stage_policies`: a plan stage's memory policies (recompute, activation and
  module-input offload) as ``TransformerConfig`` fields.
- :mod:`.model`: ``GPTModel`` (:func:`~.model.gpt_model`, on the local or Transformer Engine
  layer spec) and Megatron's ``DistributedDataParallel`` around model chunks
  (:func:`~.model.wrap_ddp`).
- :mod:`.cpu_backend`: ``enable_cpu_backend()``, the redirects that make megatron-core run on CPU.
- :mod:`.cpu_offload`: ``enable_cpu_offload()``, megatron-core's optimizer offload and
  fine-grained activation offloading on the CPU backend (the runtime's and the rehearsal's).
- ``tests/mcore/cuda_coverage.py``: the scan of megatron-core's source that pins the backend's table.
- :mod:`.rebind`: our wrappers of Megatron's functions and methods, each applied once per
  layer (the runtime's hooks, vendors and CPU fixes, and the CPU offload fixes).
- :mod:`.expert_load`: ``ExpertTokenCounter``, the tokens the routers of a rank's MoE layers
  send to each expert in a measured step (the runtime's and the rehearsal's telemetry).
- :mod:`.spawn`: ``spawn(fn, world_size)``, N gloo processes with results and failures collected.
- :mod:`.warmup_schedule`: the non-interleaved 1F1B with the plan's per-stage warm-up, from
  megatron-core's ``forward_step``, ``backward_step`` and ``P2PCommunicator`` (``schedule_for``).
- :mod:`.mesh_grids`, :mod:`.mesh_stage`, :mod:`.mesh_train`: a mesh plan's grids and bridges,
  one rank's model slice and schedule collection, and its training with Megatron's DDP,
  optimizer and ``finalize_model_grads`` per mesh (``build_mesh_rank``; megatron-core 0.17).

``runtime``, ``emulate`` and ``profiler`` build megatron-core objects through this package and
never import one another. It depends on :mod:`megatron_hetero.plan` (and its
:mod:`megatron_hetero.schedule.rules`) and :mod:`megatron_hetero.models` only. Importing it
imports neither torch nor megatron; the submodules do where they build something.
"""
