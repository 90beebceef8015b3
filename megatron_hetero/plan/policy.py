"""A stage's memory policy in the plan (``recompute`` and ``offload`` of each stage of
:mod:`megatron_hetero.plan`): what it recomputes, what it keeps in host memory, and how an
interleaved stage's recompute falls on its model chunks.

Both are frozen and hashable, and each keeps its hash, computed once: the cost model's caches
and the tuner's memos key on stage shapes that hold them, and build millions of such keys in
one search.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..errors import SchemaError

__all__ = ["Recompute", "Offload", "chunk_recompute"]

@dataclass(frozen=True, kw_only=True, slots=True)
class Recompute:
    """Activation recomputation of one stage (Megatron's ``--recompute-*`` for that stage)."""

    granularity: Literal["none", "selective", "full"] = "none"
    method: Literal["uniform", "block"] | None = None
    """Required with ``full``: how Megatron picks the recomputed layers."""
    num_layers: int | None = None
    """Required with ``full``: layers per recompute chunk (uniform) or layers recomputed (block).
    With interleaving the counts stay per stage: ``block`` covers the stage's first
    ``num_layers`` layers in chunk order (chunk 0 first); ``uniform`` groups apply in every
    chunk (the runtime needs ``num_layers`` to divide each chunk's layers)."""
    _hash: int = field(init=False, compare=False, repr=False, metadata={"internal": True})
    """The hash of the fields above (as the dataclass's own), computed once."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.granularity, self.method, self.num_layers)))
        if self.granularity == "full":
            if self.method is None:
                raise SchemaError("", "method", None, "'uniform' or 'block' with granularity full")
            if self.num_layers is None or self.num_layers < 1:
                raise SchemaError("", "num_layers", self.num_layers,
                                  "a positive integer with granularity full")
        else:
            for key in ("method", "num_layers"):
                if getattr(self, key) is not None:
                    raise SchemaError("", key, getattr(self, key),
                                      f"nothing with granularity {self.granularity!r}")

    def __hash__(self) -> int:
        return self._hash

    def __getstate__(self) -> tuple:
        return self.granularity, self.method, self.num_layers

    def __setstate__(self, state: tuple) -> None:
        # a string's hash differs from process to process: a copy computes its own
        for name, value in zip(("granularity", "method", "num_layers"), state):
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_hash", hash(state))

    @classmethod
    def full_layers(cls, layers: int, *, of: int) -> Recompute:
        """Full recompute of ``layers`` of a stage's ``of`` layers: none at 0, Megatron's
        ``block`` method below ``of``, ``uniform`` groups of one layer when it covers them all."""
        if not 0 <= layers <= of:
            raise ValueError(f"{layers} layers of recompute on a stage of {of}")
        if layers == 0:
            return cls()
        if layers == of:
            return cls(granularity="full", method="uniform", num_layers=1)
        return cls(granularity="full", method="block", num_layers=layers)

    def recomputed_layers(self, n: int) -> int:
        """Layers of a stage (or model chunk) of ``n`` layers whose forward is recomputed in full."""
        if self.granularity != "full":
            return 0
        return n if self.method == "uniform" else min(self.num_layers, n)


@dataclass(frozen=True, kw_only=True, slots=True)
class Offload:
    """What one stage keeps in host memory instead of device memory."""

    optimizer_fraction: float = 0.0
    """Fraction of the optimizer state (and its step) held and run on the CPU
    (Megatron's ``--optimizer-cpu-offload --optimizer-offload-fraction``)."""
    activations: bool = False
    """Offload saved activations to host memory (needs a megatron-core that allows it with PP > 1)."""
    module_inputs: bool = False
    """Offload the tensors that each layer's attention norm, QKV projection, core attention,
    attention output projection and MLP norm save for backward (their inputs) to host memory,
    copied on side streams while the layer computes and fetched back ahead of its backward:
    megatron-core's fine-grained activation offloading (``--fine-grained-activation-offloading
    --offload-modules attn_norm qkv_linear core_attn attn_proj mlp_norm``, 0.17 and later,
    Transformer Engine layers only). Unlike ``activations`` it runs with pipeline parallelism
    and interleaving. The MLP's own activations stay on the device."""
    _hash: int = field(init=False, compare=False, repr=False, metadata={"internal": True})
    """The hash of the fields above (as the dataclass's own), computed once."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.optimizer_fraction, self.activations,
                                                self.module_inputs)))
        if not 0.0 <= self.optimizer_fraction <= 1.0:
            raise SchemaError("", "optimizer_fraction", self.optimizer_fraction,
                              "a fraction in [0, 1]")

    def __hash__(self) -> int:
        return self._hash

    @property
    def any(self) -> bool:
        return self.optimizer_fraction > 0 or self.activations or self.module_inputs


def chunk_recompute(recompute: Recompute, chunk_layers) -> tuple[Recompute, ...]:
    """The recompute of each model chunk of an interleaved stage whose chunks hold
    ``chunk_layers``: ``block`` recompute of ``k`` layers covers the stage's first ``k`` layers
    in chunk order (chunk 0 first: it keeps the most micro-batches in flight), so a chunk past
    them recomputes nothing; ``uniform`` and ``selective`` apply in every chunk. The cost model
    and the runtime both take each chunk's setting from here."""
    if recompute.granularity != "full" or recompute.method != "block":
        return (recompute,) * len(chunk_layers)
    out, before = [], 0
    for n in chunk_layers:
        covered = max(0, min(recompute.num_layers - before, n))
        before += n
        out.append(Recompute(granularity="full", method="block", num_layers=covered)
                   if covered else Recompute())
    return tuple(out)
