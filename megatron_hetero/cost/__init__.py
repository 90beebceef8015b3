"""Cost model: compute, memory and communication per device type; measured profiles."""

from .model import CostModel
from ..placement.nodes import Node, Placement, place
from .profile_protocol import DeviceProfile, Part
from .stage import Memory, StageShape, StageTimes

__all__ = ["CostModel", "Memory", "StageShape", "StageTimes", "Node", "Placement", "place",
           "DeviceProfile", "Part"]
