"""``megatron-hetero profile``: measure per-layer costs of real megatron-core modules on this device.

For each tensor-parallel size, the profiler builds a one-layer megatron-core ``GPTModel`` (the
Transformer Engine layer spec when TE is installed, the local spec otherwise) and times its parts
one at a time, for each micro-batch size:

- ``embedding``: ``model.embedding`` (word and, if any, position embeddings);
- ``layer``: ``model.decoder.layers[0]``, with the model's rotary embedding;
- ``output``: ``model.decoder.final_layernorm``, ``model.output_layer`` and the model's own
  ``compute_language_model_loss``.

Each part runs ``warmup`` untimed iterations, then ``repeats`` timed ones, forward and backward
timed separately; the file keeps the median (on a GPU from CUDA events; on CPU from the
calling thread's CPU time when torch computes on one thread, else from wall-clock time). With TP
> 1 every rank of the group times the part and the slowest rank's median is kept.

Memory: on a GPU, ``torch.cuda`` allocator figures (bytes allocated by one layer's forward, and
the peak over its forward and backward). On CPU there is no allocator peak to read; the
profiler counts the bytes autograd saves for backward through
``torch.autograd.graph.saved_tensors_hooks`` (each storage once, parameters excluded) and
reports ``peak_bytes`` as parameters + gradients + those saved bytes.

With more than one rank it also times p2p send/recv between ranks 0 and 1 and an all-reduce over
all ranks. TP > 1 needs that many processes: the profiler starts them itself (``torch.multiprocessing``
on the CPU backend, or on the visible GPUs), unless it runs under ``torchrun`` already.

torch and megatron are imported inside the functions, never at module import.

Modules: :mod:`.request` (what to measure), :mod:`.launch` (processes), :mod:`.rank` (one rank's
run), :mod:`.device` (GPU or CPU, precision, clocks), :mod:`.build` (the megatron-core model),
:mod:`.parts` (embedding, layer and output timings, memory), :mod:`.pipeline` (the 2-stage 1F1B
pipeline), :mod:`.bandwidth` (p2p and all-reduce), :mod:`.assembly` (the profile file's
contents), :mod:`.cli` (``megatron-hetero profile``).
"""

from __future__ import annotations

from .cli import profile_main, resolve_model  # noqa: F401
from .launch import request_timeout, run_profile  # noqa: F401
from .request import CPU_DEVICE_TYPE, ProfileRequest, layer_flops  # noqa: F401

__all__ = ["ProfileRequest", "run_profile", "layer_flops", "profile_main"]
