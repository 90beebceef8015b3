"""CPU emulation: run real megatron-core on CPU processes, one process per emulated GPU.

- :mod:`.trainer`: ``train_plan(plan)`` / ``train_rank(plan, rank)``, a mini trainer of a plan,
  with its parameters under layout-independent names in :mod:`.params`.
- :mod:`.speed`: speed emulation of each rank's device type.
- :mod:`.memory`: memory emulation (saved-activation accounting, per-rank caps).
- :mod:`.rehearse`: ``rehearse(plan)``, a plan run on CPU processes against its prediction, with
  its parts in :mod:`.shrink` (the shrunk plan), :mod:`.host` (host capacity, time
  scale), :mod:`.calibration` (per-device start-up calibration), :mod:`.drift` (CPU drift
  rescaling), :mod:`.prediction` (the emulated cluster's prediction), :mod:`.rank_hooks` (what
  each rank runs around the trainer), :mod:`.links` (link emulation: pipeline messages take the
  time of their link in the inventory) and :mod:`.report` (per-stage results and the printout).
- :mod:`.mesh_trainer`: ``train_mesh_plan(plan)`` / ``train_mesh_rank``, the mini trainer of a
  mesh plan (format 2), and :mod:`.mesh_rehearse`, its rehearsal against the simulator.

megatron-core's objects, the CPU backend and the gloo process spawner come from
:mod:`megatron_hetero.mcore`. Importing this package imports neither torch nor megatron; the
submodules do.
"""
