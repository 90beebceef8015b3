"""What the cost model asks of a measured device profile (see the profiler for the file format).

A profile belongs to one device type. It answers with measured seconds where it has them and
``None`` where it does not; the cost model then falls back to the analytic estimate, scaled by the
profile's measured ``efficiency`` when that is known.
"""

from __future__ import annotations

from typing import Literal, Protocol, runtime_checkable

from ..plan import ModelSpec

__all__ = ["DeviceProfile", "Part"]

Part = Literal["layer", "embedding", "output"]
"""``layer``: one transformer layer; ``embedding``: the input embedding; ``output``: the output
layer with its loss."""


@runtime_checkable
class DeviceProfile(Protocol):
    device_type: str
    """Canonical catalog name of the profiled device."""

    @property
    def efficiency(self) -> float | None:
        """Measured fraction of the catalog's bf16_tflops a transformer layer achieved."""

    def times(self, part: Part, *, model: ModelSpec, micro_batch_size: int,
              tensor_parallel_size: int) -> tuple[float, float] | None:
        """Measured (forward, backward) seconds of ``part`` for one micro-batch, or None when
        this profile did not measure that model shape, micro-batch size and TP size."""
