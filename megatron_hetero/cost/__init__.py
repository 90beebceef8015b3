"""Cost model: compute, memory and communication per device type; measured profiles."""
