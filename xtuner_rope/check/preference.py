"""``xtuner-rope check`` for XTuner's preference models (DPO, ORPO, reward model).

The first batch goes through ``compute_loss`` as in a training step while
:class:`~xtuner_rope.capture.preference.PreferenceCaptureHook` records what the model computed;
:func:`~xtuner_rope.capture.preference.compare_preference_capture` then runs each response
alone through the unpatched model, and the packed row unpatched (the leak).
"""

from __future__ import annotations

from pathlib import Path

import torch
from mmengine.config import Config

from xtuner_rope.capture.measure import BOUNDARY_HOOKS
from xtuner_rope.capture.preference import (
    PreferenceCaptureHook,
    capture_file,
    compare_preference_capture,
)
from xtuner_rope.check.report import TOLERANCES
from xtuner_rope.check.runner import CheckRequest, apply_patch, prepared_runner
from xtuner_rope.compat.mmengine_config import config_dict
from xtuner_rope.config.fields import type_name
from xtuner_rope.config.findings import MODEL_RESOURCE_EDIT
from xtuner_rope.config.preference import PREFERENCE_MODELS
from xtuner_rope.models import channel

# Tolerances: check.report.TOLERANCES of the dtype checked, relative to max(1, |value|) (its
# "logits" entry for log-probs, scores and states, "loss" for the loss).
KIND = "preference"


def applies(cfg: Config) -> bool:
    """True for a config whose model is XTuner's DPO, ORPO or RewardModel (``KINDS``)."""
    model = config_dict(cfg).get("model")
    return isinstance(model, dict) and type_name(model.get("type")) in PREFERENCE_MODELS


def _training_forward(runner, hooks: dict, work_dir: Path) -> Path:
    """One training forward of the first batch, captured; no optimizer step."""
    data_batch = next(iter(runner.train_dataloader))
    capture = PreferenceCaptureHook(at_iter=runner.iter)
    capture.before_train_iter(runner, 0, data_batch)
    boundary = [hooks[n] for n in BOUNDARY_HOOKS if n in hooks]
    for hook in boundary:
        hook.before_train_iter(runner, 0, data_batch)
    data = data_batch["data"]
    if not boundary and "cumulative_len" in data:  # XTuner's varlen hook, without the plugin
        channel.publish(data.pop("cumulative_len")[0], data.pop("max_seqlen", None), rank=0)
    data = runner.model.data_preprocessor(data_batch, True)
    losses = runner.model(**data, mode="loss")
    capture.after_train_iter(runner, 0, data_batch, {"loss": losses["loss"].detach().mean()})
    for hook in boundary:
        hook.after_train_iter(runner, 0, data_batch)
    return work_dir / capture_file()


def _problems(result: dict, patched: bool, tol: dict | None = None) -> list[str]:
    tol = tol or TOLERANCES["float32"]
    problems = []
    for name, values in result["alone"].items():
        scale = max(1.0, max(abs(v) for v in values))
        if result["max_abs_diff"][name] > tol["logits"] * scale:
            problems.append(
                f"{name}: packed differs from each response alone by "
                f"{result['max_abs_diff'][name]:.3g}: responses attend to each other"
            )
    loss = result["loss"]
    if "alone" in loss and abs(loss["captured"] - loss["alone"]) > tol["loss"] * max(
        1.0, abs(loss["alone"])
    ):
        problems.append(
            f"loss: packed {loss['captured']:.6f} vs responses alone {loss['alone']:.6f}"
        )
    states = result["reward_token_states"]
    if states and states["max_abs_diff"] > tol["logits"] * max(1.0, states["max_abs"]):
        problems.append(
            f"reward token states: packed differ from each response alone by "
            f"{states['max_abs_diff']:.3g}: responses attend to each other"
        )
    if problems and not patched:
        problems.append(f"xtuner-rope's patch is not applied: to enable it, {MODEL_RESOURCE_EDIT}")
    return problems


def run(cfg: Config, request: CheckRequest) -> dict:
    """Measure a started preference config (the kind's entry in ``KINDS``; the module docstring)
    with ``check.report.TOLERANCES`` of the dtype checked: the JSON-ready report
    (``kind='preference'``), with ``verdict``, ``problems`` and ``exit_code`` (1 on a leak)."""
    work_dir = Path(request.work_dir)
    # each response alone runs fp32, summed in float64
    runner, _, dt, hooks = prepared_runner(cfg, work_dir, request.dtype)
    tol = TOLERANCES[str(dt).replace("torch.", "")]
    patched = apply_patch(runner, hooks)
    with torch.enable_grad():
        capture = _training_forward(runner, hooks, work_dir)
    result = compare_preference_capture(cfg, capture)
    problems = _problems(result, patched, tol)
    verdict = (
        "FAIL: " + problems[0]
        if problems
        else f"PASS: every response of the packed pairs gets the "
        f"{'reward score' if result['kind'] == 'reward' else 'log-probs'} it gets alone"
    )
    return {
        "kind": "preference",
        "config": str(request.config),
        "plugin": {"patched": patched},
        "model": result["kind"],
        "dtype": str(dt).replace("torch.", ""),
        "tolerance": tol,
        **{
            k: result[k]
            for k in ("pairs", "max_abs_diff", "leak_max_abs_diff", "loss", "reward_token_states")
        },
        "problems": problems,
        "verdict": verdict,
        "exit_code": 1 if problems else 0,
    }


def summary(report: dict) -> str:
    """The short text printed by ``xtuner-rope check`` for a preference model (``KINDS``)."""
    lines = [
        f"xtuner-rope check: {report['config']}",
        f"  model    XTuner {report['model']} model, {report['pairs']} pairs in the first "
        f"packed row, {'patched' if report['plugin']['patched'] else 'not patched'}, "
        f"{report['dtype']} (tolerance {report['tolerance']['logits']:.3g} relative)",
    ]
    for name, diff in report["max_abs_diff"].items():
        lines.append(
            f"  {name:<18} max |packed - alone| {diff:.3g}  (unpatched packed row: "
            f"{report['leak_max_abs_diff'][name]:.3g})"
        )
    states = report["reward_token_states"]
    if states:  # the reward head starts at zero: the states it reads show a leak at once
        lines.append(
            f"  reward token states max |packed - alone| {states['max_abs_diff']:.3g}  "
            f"(unpatched packed row: {states['leak_max_abs_diff']:.3g})"
        )
    if "alone" in report["loss"]:
        lines.append(
            f"  loss     packed {report['loss']['captured']:.6f} vs responses alone "
            f"{report['loss']['alone']:.6f}"
        )
    return "\n".join([*lines, *[f"  problem: {p}" for p in report["problems"]], report["verdict"]])
