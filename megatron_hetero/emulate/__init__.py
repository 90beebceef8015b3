"""CPU emulation: run real megatron-core on CPU processes, one process per emulated GPU.

- :mod:`.trainer`: ``train_plan(plan)`` / ``train_rank(plan, rank)``, the mini trainer of a plan
  of any shape, with its parameters under layout-independent names in :mod:`.params` and its
  two megatron-core backends (one grid: megatron-core's own schedules; a chain of meshes: the
  multimodule communicator) behind one interface in :mod:`.rank_backends`.
- :mod:`.speed`: speed emulation of each rank's device type.
- :mod:`.memory`: memory emulation (saved-activation accounting, per-rank caps).
- :mod:`.rehearse`: ``rehearse(plan)``, a plan (any shape) run on CPU processes against its
  prediction, with
  its parts in :mod:`.shrink` (the shrunk plan), :mod:`.host` (host capacity, time
  scale), :mod:`.calibration` (per-device start-up calibration), :mod:`.drift` (CPU drift
  rescaling), :mod:`.prediction` (the emulated cluster's prediction), :mod:`.rank_hooks` (what
  each rank runs around the trainer), :mod:`.links` (link emulation: pipeline messages take the
  time of their link in the inventory) and :mod:`.report` (per-stage results and the printout).

megatron-core's objects, the CPU backend and the gloo process spawner come from
:mod:`megatron_hetero.mcore`. Importing this package imports neither torch nor megatron; the
submodules do.
"""
