"""Runtime hooks that apply a plan inside Megatron-LM (``--hetero-plan plan.yaml``).

Importing this package does not import torch or megatron; the submodules that need them do.

``hooks``       wraps Megatron-LM's own functions (``install()``); the entry point: one
                :class:`~.hooks.Runtime` per process, the backend picked from the plan's shape
``backend``     what a backend does at each hook point
``core_run``    megatron-core's own schedules (every stage shares TP and DP: format-1 plans)
``mesh_run``    megatron-core's multimodule pipeline (mesh plans), with ``mesh_state``,
                ``mesh_model``, ``mesh_checkpoint`` and ``meshes`` (the version gate)
``placement``   device detection, rank exchange and the launcher-rank -> Megatron-rank assignment
``plan_args``   the plan's implied arguments checked against (and filled into) the command line
``sampler``     each replica's share of every global batch, resumable
``policies``    per-stage recompute and offload as per-rank settings; refusal of what cannot work
``cpu``         megatron.training on the CPU backend (``MEGATRON_HETERO_CPU=1``: ``cpu_mode()``
                of :mod:`megatron_hetero.mcore.cpu_backend`)
``cpu_offload`` megatron-core's optimizer offload and fine-grained activation offloading there
``patching``    ``megatron-hetero patch-megatron``
``arguments``   ``--hetero-plan`` / ``--hetero-device-type``
"""
