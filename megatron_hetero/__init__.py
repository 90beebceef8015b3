"""megatron-hetero: plan and run Megatron-LM training on a mixed pool of GPUs.

The tuner side (plans, inventories, cost model, search) is pure Python and never imports torch.
"""

from ._version import __version__
from .errors import HeteroError, InfeasibleError, SchemaError
from .hardware import Catalog, GPUSpec, Inventory, load_catalog, load_inventory
from .megatron_args import megatron_args, megatron_args_line
from .plan import Plan, load_plan, save_plan

__all__ = ["__version__", "HeteroError", "InfeasibleError", "SchemaError", "Catalog", "GPUSpec",
           "Inventory", "load_catalog", "load_inventory", "megatron_args", "megatron_args_line",
           "Plan", "load_plan", "save_plan"]
