"""CPU emulation: run real megatron-core on CPU processes, one process per emulated GPU.

- :mod:`.cpu_backend`: ``enable_cpu_backend()``, the redirects that make megatron-core run on CPU.
- :mod:`.spawn`: ``spawn(fn, world_size)``, N gloo processes with results and failures collected.
- :mod:`.trainer`: ``train_plan(plan)`` / ``train_rank(plan, rank)``, a mini trainer of a plan.
- :mod:`.speed`: speed emulation of each rank's device type.

Importing this package imports neither torch nor megatron; the submodules do.
"""
