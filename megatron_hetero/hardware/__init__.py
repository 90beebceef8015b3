"""GPU catalog and inventory schema."""

from .catalog import Catalog, GPUOverride, GPUSpec, load_catalog
from .inventory import GPUGroup, Inventory, inventory_from_data, load_inventory

__all__ = ["Catalog", "GPUOverride", "GPUSpec", "load_catalog", "GPUGroup", "Inventory",
           "inventory_from_data", "load_inventory"]
