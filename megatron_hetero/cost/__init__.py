"""Cost model: compute, memory and communication per device type; measured profiles."""

from .model import CostModel, Memory, RecomputeKey, StageTimes, recompute_key
from .placement import Node, Placement, place
from .profile_protocol import DeviceProfile, Part

__all__ = ["CostModel", "Memory", "StageTimes", "RecomputeKey", "recompute_key", "Node",
           "Placement", "place", "DeviceProfile", "Part"]
