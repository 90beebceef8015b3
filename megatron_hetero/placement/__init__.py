"""Where a plan's ranks sit in an inventory, and whether the pool holds the plan.

- :mod:`.nodes`: tensor-parallel groups handed to nodes in rank order, and the link two slots
  share;
- :mod:`.meshes`: the same for mesh plans;
- :mod:`.host_path`: the path between nodes of two vendors, staged through the hosts;
- :mod:`.inventory`, :mod:`.mesh_inventory`: a plan checked against an inventory (the GPUs it
  asks for, whole tensor-parallel groups inside nodes, the figures it was tuned with).

It sits between the plan and the cost model: the cost model prices the links it finds here.
"""
