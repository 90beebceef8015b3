"""Runs of the mesh-trainer tests (importable by name; each test runs one in a subprocess under
megatron-core of tests.conftest.STACKS)."""

from __future__ import annotations


def train_against_one_process(plan_path: str, clip_grad: float) -> dict:
    """Train the mesh plan at ``plan_path`` 3 steps with Adam and gradient clipping at
    ``clip_grad``, with the plain and with the distributed optimizer, and its one-process
    reference once; return each run's losses, every rank's gradient norms and the first
    divergence from the reference (losses, forward-only loss, parameters: rtol 1e-5, atol 1e-5,
    1% of an Adam step) or None."""
    from megatron_hetero.emulate.trainer import (TrainConfig, compare_results, reference_plan,
                                                 train_plan)
    from megatron_hetero.plan import load_any_plan

    plan = load_any_plan(plan_path)
    out = {}
    ref = train_plan(reference_plan(plan), TrainConfig(steps=3, clip_grad=clip_grad))
    out["reference"] = {"losses": ref.losses, "grad_norms": ref.ranks[0].grad_norms}
    for name, dist_opt in (("plain", False), ("distributed", True)):
        got = train_plan(plan, TrainConfig(steps=3, clip_grad=clip_grad,
                                           use_distributed_optimizer=dist_opt))
        out[name] = {"losses": got.losses, "grad_norms": [r.grad_norms for r in got.ranks],
                     "diverges": compare_results(got, ref, rtol=1e-5, atol=1e-5)}
    return out


def check_against_one_process(got: dict, *, world: int, clip: float) -> None:
    """Assert what :func:`train_against_one_process` returned of a plan of ``world`` ranks: the
    reference clips (every norm above twice ``clip``) and trains, and each optimizer's run
    matches it, every rank's gradient norm the whole model's."""
    import pytest

    ref = got["reference"]
    assert all(n > 2 * clip for n in ref["grad_norms"]), ref  # clipping is active
    assert ref["losses"][2] < ref["losses"][0]  # it trains
    for optimizer in ("plain", "distributed"):
        run = got[optimizer]
        assert run["diverges"] is None, (optimizer, run["diverges"])
        assert len(run["grad_norms"]) == world
        for norms in run["grad_norms"]:  # every rank: the norm of the whole model
            assert norms == pytest.approx(ref["grad_norms"], rel=1e-5), (optimizer, norms, ref)


def train_interleaved_against_one_process(plan_path: str, lr: float, clip_grad: float) -> dict:
    """Train the interleaved mesh plan at ``plan_path`` 3 steps against its one-process
    reference: with SGD at ``lr``, no clipping and the plain optimizer (``sgd``: a gradient off
    by a factor shows in the parameters), and with Adam clipping at ``clip_grad`` and the
    distributed optimizer (``adam``: megatron-core's distributed optimizer takes no SGD).
    Returns per run the reference's losses and gradient norms, the run's losses and every
    rank's gradient norms, the first divergence (rtol 1e-5; atol 1e-6 with SGD, 0.2% of a step
    here, 1e-5 with Adam, as the mesh-trainer tests) or None, and the largest relative
    difference of the losses and absolute difference of the parameters."""
    from megatron_hetero.emulate.trainer import (TrainConfig, compare_results, reference_plan,
                                                 train_plan)
    from megatron_hetero.plan import load_any_plan

    plan = load_any_plan(plan_path)
    runs = {"sgd": (dict(optimizer="sgd", lr=lr, clip_grad=0.0), False, 1e-6),
            "adam": (dict(optimizer="adam", clip_grad=clip_grad), True, 1e-5)}
    out = {}
    for name, (config, dist_opt, atol) in runs.items():
        ref = train_plan(reference_plan(plan), TrainConfig(steps=3, **config))
        got = train_plan(plan, TrainConfig(steps=3, **config, use_distributed_optimizer=dist_opt))
        out[name] = {
            "reference": {"losses": ref.losses, "grad_norms": ref.ranks[0].grad_norms},
            "losses": got.losses, "grad_norms": [r.grad_norms for r in got.ranks],
            "diverges": compare_results(got, ref, rtol=1e-5, atol=atol),
            "loss_rel": max(abs(a - b) / abs(b) for a, b in zip(got.losses, ref.losses)),
            "param_abs": max(float((got.params[k] - ref.params[k]).abs().max())
                             for k in ref.params if k in got.params)}
    return out


def rehearse_verified(plan_path: str) -> dict:
    """Rehearse the plan at ``plan_path`` (3 steps, hidden 8, memory metered, not capped) with
    ``--verify``: its rows ``[mesh, stage of the model, replica]``, the verification message
    (None: it matches), the measured and the predicted step."""
    from megatron_hetero.emulate.rehearse import RehearsalConfig, rehearse
    from megatron_hetero.plan import load_any_plan

    got = rehearse(load_any_plan(plan_path),
                   RehearsalConfig(steps=3, hidden_size=8, memory_cap=False), verify=True)
    return {"rows": [[s.mesh, s.stage, s.pipeline] for s in got.stages],
            "verify": got.verify_message, "measured": got.step_s,
            "predicted": got.predicted_step_s}


def rehearse_with_and_without_offload(plan_path: str, hidden_size: int) -> dict:
    """Rehearse the mesh plan at ``plan_path`` (2 steps, memory metered and not capped) as it
    is, with ``--verify``, then with every stage's offload removed (one device type: the second
    run reuses the first's calibration); return each run's rows ``[mesh, stage, replica, peak
    bytes, cap bytes]`` and the first run's verification outcome (None: passed)."""
    from megatron_hetero.emulate.rehearse import RehearsalConfig, rehearse
    from megatron_hetero.plan import load_any_plan, mesh_plan_from_data

    plan = load_any_plan(plan_path)
    (device,) = plan.device_counts()
    data = plan.to_data()
    for mesh in data["meshes"]:
        for stage in mesh["stages"]:
            stage.pop("offload", None)
    plain = mesh_plan_from_data(data, source="<without offload>", catalog=plan.catalog)
    config = RehearsalConfig(steps=2, hidden_size=hidden_size, memory_cap=False)
    out, calibration = {}, None
    for name, p in (("offload", plan), ("none", plain)):
        got = rehearse(p, config, verify=name == "offload", calibration=calibration)
        calibration = {device: got.calibration}
        out[name] = {"rows": [[s.mesh, s.stage, s.pipeline, s.peak_bytes, s.cap_bytes]
                              for s in got.stages],
                     "verify": _verify_outcome(got)}
    return out


def _verify_outcome(result) -> str | None:
    """None where ``--verify`` passed (fp32: equal to one process; bf16/fp16: its verdict),
    else what failed."""
    verdict = result.precision_verdict
    if verdict is None:
        return result.verify_message
    return None if verdict.ok else repr(verdict)
