"""The discrete-event simulator of one training step: :mod:`.step` (``simulate``, one code
path for every plan: a chain of meshes, one grid being a chain of one mesh), :mod:`.result`
(what a simulated step gives), :mod:`.pipeline` (one path's 1F1B, op by op or in bounded time),
:mod:`.fits` (a simulated plan against its cards and hosts).
"""
