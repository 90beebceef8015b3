"""Where a plan's ranks sit in an inventory, and whether the pool holds the plan.

- :mod:`.nodes`: every (mesh, stage, replica) tensor-parallel group handed to a node in rank
  order (``place``, one placement for every plan shape), and the link two slots share;
- :mod:`.host_path`: the path between nodes of two vendors, staged through the hosts;
- :mod:`.inventory`: a plan checked against an inventory, one check for every shape (the GPUs it
  asks for, whole tensor-parallel groups inside nodes, the figures it was tuned with).

It sits between the plan and the cost model: the cost model prices the links it finds here.
"""
