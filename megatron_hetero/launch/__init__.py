"""Launching a plan: ``python -m megatron_hetero.launch`` (:mod:`.__main__`, Megatron-LM's own
script with the hooks installed), the Slurm job's components and host files (:mod:`.jobspec`),
node loss and resubmission (:mod:`.node_loss`), and what a checkpoint folder holds
(:mod:`.checkpoint`, read without torch).

Importing this package imports nothing heavy: only ``__main__`` loads the runtime.
"""
