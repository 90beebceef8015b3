"""The discrete-event simulator of one training step: :mod:`.step` (a format-1 plan),
:mod:`.mesh` (a mesh plan), :mod:`.pipeline` (one pipeline's 1F1B, op by op or in bounded
time), :mod:`.fits` (a simulated plan against its cards and hosts).
"""
