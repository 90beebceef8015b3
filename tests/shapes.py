"""Stage shapes for cost-model tests: a stage named by its place in a pipeline."""

from __future__ import annotations

from megatron_hetero.cost.stage import StageShape

_PLACES = {"only": (1, 0), "first": (3, 0), "middle": (3, 1), "last": (3, 2)}


def stage(device_type: str, layers: int | tuple[int, ...], *, place: str = "middle",
          micro_batch_size: int = 1, **fields) -> StageShape:
    """A stage of ``layers`` (a count, or the layers of each model chunk) at ``place``: the
    single stage (``only``), or the first, a middle or the last stage of three; ``fields``
    set the rest (``in_flight=f`` puts a middle stage where it holds ``f`` micro-batches)."""
    p, s = _PLACES[place]
    in_flight = fields.pop("in_flight", None)
    if in_flight is not None:
        assert place == "middle", "in_flight places a middle stage"
        p, s = max(in_flight, 2) + 1, 1
        fields.setdefault("num_microbatches", in_flight)
    chunks = (layers,) if isinstance(layers, int) else tuple(layers)
    fields.setdefault("num_microbatches", p)
    return StageShape(device_type=device_type, chunk_layers=chunks,
                      micro_batch_size=micro_batch_size, pipeline_size=fields.pop("pipeline_size", p),
                      stage=fields.pop("stage", s), **fields)
