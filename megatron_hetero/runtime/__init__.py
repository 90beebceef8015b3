"""Runtime hooks that apply a plan inside Megatron-LM.

Importing this package does not import torch or megatron; the submodules that need them do.
"""
