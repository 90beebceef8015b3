"""CPU emulation: run real megatron-core on CPU processes, one process per emulated GPU.

- :mod:`.cpu_backend`: ``enable_cpu_backend()``, the redirects that make megatron-core run on CPU.
- :mod:`.spawn`: ``spawn(fn, world_size)``, N gloo processes with results and failures collected.
- :mod:`.trainer`: ``train_plan(plan)`` / ``train_rank(plan, rank)``, a mini trainer of a plan.
- :mod:`.speed`: speed emulation of each rank's device type.
- :mod:`.rehearse`: ``rehearse(plan)``, a plan run on CPU processes against its prediction, with
  its parts in :mod:`.shrink` (the shrunk model and plan), :mod:`.host` (host capacity, time
  scale), :mod:`.calibration` (per-device start-up calibration), :mod:`.drift` (CPU drift
  rescaling), :mod:`.prediction` (the emulated cluster's prediction), :mod:`.rank_hooks` (what
  each rank runs around the trainer) and :mod:`.report` (per-stage results and the printout).

Importing this package imports neither torch nor megatron; the submodules do.
"""
