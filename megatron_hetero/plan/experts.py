"""Expert parallelism in a plan: the checks both file formats run on a mesh's
``expert_model_parallel_size`` (EP) and ``expert_tensor_parallel_size`` (ETP).

megatron-core carves its expert grid out of the same ranks as the dense one
(``parallel_state.initialize_model_parallel``): per pipeline stage the ``T x D`` ranks of the
tensor and data-parallel groups, in ``tp-dp`` order, are cut into blocks of ``ETP x EP``
consecutive ranks; a block's ranks with one expert-TP rank form an EP group, and the blocks
are the expert-data-parallel replicas (``EDP = T D / (ETP EP)``, which must be whole). So an EP
group lies inside one mesh (the keys are a mesh's) and inside one stage; it spans the replicas
of its block (:meth:`.types.Mesh.expert_blocks`). What is refused here, each at its field path:

* EP or ETP on a dense model (no ``num_experts``);
* EP not dividing ``num_experts``; ETP not dividing ``moe_ffn_hidden_size``; ETP > 1 with
  ``add_bias_linear`` (megatron-core: "Bias in Moe is only supported when ETP==1");
* ``ETP x EP`` not dividing ``T x D``;
* TP > 1 on an MoE model without sequence parallelism (megatron-core's MoE layer refuses to
  train so; a mesh plan's ``sequence_parallel`` turns it on in every mesh of TP > 1);
* a block whose replicas run different micro-batch counts: every MoE layer of every
  micro-batch runs one dispatch and one combine all-to-all over the EP group, and a replica
  with fewer micro-batches would leave its peers waiting for ever;
* a block whose replicas run a stage on GPUs of different vendors (:func:`check_expert_vendors`:
  one collective library per group).
"""

from __future__ import annotations

from ..errors import SchemaError
from .stages import ModelSpec

__all__ = ["check_experts", "check_expert_vendors", "expert_data", "expert_blocks"]


def check_experts(model: ModelSpec, *, tp: int, ep: int, etp: int | None,
                  pipelines: list, sequence_parallel: bool, where: str,
                  replicas: str) -> None:
    """Check one mesh's expert keys (module docstring). ``where``: the field path prefix of the
    keys (``""`` for format 1, ``meshes[k].`` for format 2); ``replicas``: the path of the
    mesh's replica list (``pipelines``, ``meshes[k].replicas``)."""
    if ep < 1:
        raise SchemaError("", f"{where}expert_model_parallel_size", ep, "a positive integer")
    if etp is not None and etp < 1:
        raise SchemaError("", f"{where}expert_tensor_parallel_size", etp, "a positive integer")
    e = model.num_experts
    if e is None:
        if ep != 1:
            raise SchemaError("", f"{where}expert_model_parallel_size", ep,
                              "1: the model has no experts (model.num_experts is not set)")
        if etp is not None:
            raise SchemaError("", f"{where}expert_tensor_parallel_size", etp,
                              "absent: the model has no experts (model.num_experts is not set)")
        return
    if e % ep:
        raise SchemaError("", f"{where}expert_model_parallel_size", ep,
                          f"a divisor of model.num_experts ({e})")
    etp_ = tp if etp is None else etp
    f = model.expert_ffn_hidden_size
    if f % etp_:
        raise SchemaError("", f"{where}expert_tensor_parallel_size", etp_,
                          f"a divisor of the experts' FFN hidden size ({f})")
    if etp_ > 1 and model.add_bias_linear:
        raise SchemaError("", f"{where}expert_tensor_parallel_size", etp_,
                          "1 with model.add_bias_linear (megatron-core's MoE layer takes biases "
                          "only at expert TP 1)")
    d = len(pipelines)
    if (tp * d) % (etp_ * ep):
        raise SchemaError("", f"{where}expert_model_parallel_size", ep,
                          f"a size whose expert TP x EP ({etp_} x {ep}) divides the stage's "
                          f"tensor x data-parallel ranks ({tp} x {d}): megatron-core carves the "
                          "expert groups out of them")
    if tp > 1 and not sequence_parallel:
        raise SchemaError("", f"{where}tensor_model_parallel_size", tp,
                          "1 for an MoE model without sequence parallelism (megatron-core's MoE "
                          "layer does not train with TP > 1 without it: sequence_parallel: true)")
    _check_blocks(pipelines, tp=tp, size=etp_ * ep, replicas=replicas)


def expert_blocks(d: int, tp: int, size: int) -> list[range]:
    """The replicas each expert block of ``size`` (ETP x EP) consecutive ranks spans, of a
    stage of ``d`` replicas of ``tp`` tensor ranks in ``tp-dp`` order."""
    return [range(i // tp, min((i + size - 1) // tp + 1, d)) for i in range(0, tp * d, size)]


def _check_blocks(pipelines: list, *, tp: int, size: int, replicas: str) -> None:
    for block in expert_blocks(len(pipelines), tp, size):
        first = pipelines[block[0]].num_microbatches
        for r in block[1:]:
            if pipelines[r].num_microbatches != first:
                raise SchemaError("", f"{replicas}[{r}].num_microbatches",
                                  pipelines[r].num_microbatches,
                                  f"{first}, as {replicas}[{block[0]}]: the two share an "
                                  "expert-parallel group, whose all-to-alls pair up one "
                                  "micro-batch at a time")


def check_expert_vendors(plan, catalog, *, source: str) -> None:
    """Every expert block of a format-1 plan (one mesh) runs each stage on one vendor's GPUs
    (its all-to-alls use one collective library); refused at the stage's device type."""
    mesh = plan.meshes[0]
    if mesh.expert_model_parallel_size == 1:
        return
    for block in mesh.expert_blocks():
        for j in range(mesh.num_stages):
            ref = mesh.pipelines[block[0]].stages[j].device_type
            lib = catalog.get(ref).stack.library
            for r in block[1:]:
                name = mesh.pipelines[r].stages[j].device_type
                if catalog.get(name).stack.library != lib:
                    raise SchemaError(source, f"pipelines[{r}].stages[{j}].device_type", name,
                                      f"a device on {lib}, as pipelines[{block[0]}] ({ref}): "
                                      "the two share an expert-parallel group, whose "
                                      "all-to-alls run on one collective library")


def expert_data(mesh) -> dict:
    """A mesh's (:class:`.types.Mesh`) expert-parallel keys where they differ from their
    defaults, for its file (a plan without them is written as before)."""
    out: dict = {}
    if mesh.expert_model_parallel_size != 1:
        out["expert_model_parallel_size"] = mesh.expert_model_parallel_size
    if mesh.expert_tensor_parallel_size is not None:
        out["expert_tensor_parallel_size"] = mesh.expert_tensor_parallel_size
    return out
