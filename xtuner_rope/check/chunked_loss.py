"""``xtuner-rope check``: the chunked training loss against the model's own full-logits loss.

On the first batch the training step's loss runs twice: chunked (``hooks.chunked_loss``, as the
run trains) and the model's own (``models.chunked_loss.pause_chunked_loss``). The decoder's
last hidden states enter both as one detached leaf, so the backward costs one head's: it gives
the gradients of the hidden states and of the head's trainable parameters, judged with the
loss against ``check.report``'s tolerances.
"""

from __future__ import annotations

import torch

from xtuner_rope.capture.measure import BOUNDARY_HOOKS, BOUNDARY_KEYS
from xtuner_rope.hooks.chunked_loss import enable_chunked_loss
from xtuner_rope.models import channel
from xtuner_rope.models.chunked_loss import (
    causal_lm,
    chunked_loss_head,
    is_chunked,
    pause_chunked_loss,
)

__all__ = ["chunked_loss_lines", "chunked_loss_problems", "compare_chunked_loss"]


def _hidden_leaf(store: dict):
    """A forward hook that hands the decoder's output on as a detached leaf (kept in ``store``)."""

    def hook(module, args, output):
        leaf = output[0].detach().requires_grad_(True)  # [b, s, H]
        store["hidden"] = leaf
        if isinstance(output, tuple):
            return (leaf, *output[1:])
        output.last_hidden_state = leaf  # a ModelOutput: its item too
        return output

    return hook


def _loss_and_grads(runner, data_batch: dict, hooks: dict, params: list) -> dict:
    """The training step's loss on ``data_batch`` and its gradients at the hidden states."""
    data_batch = dict(data_batch, data=dict(data_batch["data"]))  # the hooks pop keys from it
    for name in BOUNDARY_HOOKS:
        if name in hooks:
            hooks[name].before_train_iter(runner, batch_idx=0, data_batch=data_batch)
    for key in BOUNDARY_KEYS:
        data_batch["data"].pop(key, None)
    store = {}
    decoder = causal_lm(runner.model.llm).get_decoder()
    handle = decoder.register_forward_hook(_hidden_leaf(store))
    for p in params:
        p.grad = None
    try:
        batch = runner.model.data_preprocessor(data_batch, True)
        loss = runner.model(**batch, mode="loss")["loss"]
        loss.backward()
    finally:
        handle.remove()
        channel.clear()  # the boundaries the hooks published, as their after_train_iter does
    return {
        "loss": float(loss.detach()),
        "hidden": store["hidden"].grad.float(),
        "head": [p.grad.float() for p in params],
    }


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def compare_chunked_loss(runner, data_batch: dict, hooks: dict, tolerance: float) -> dict:
    """The chunked loss against the model's own on one batch; see the module docstring.

    Args:
        runner: The check's Runner, its model patched by the plugin's hooks
            (``check.runner.apply_patch``; call this only then).
        data_batch: The collated batch (``{'data': ..., 'data_samples': ...}``); not modified.
        hooks: The runner's hooks by name (the boundary hooks publish the batch's boundaries).
        tolerance: The largest relative difference accepted (loss and gradients).

    Returns:
        ``startup`` (the start-up's line) and ``compared`` (False: the chunked loss does not
        run); if compared, ``loss`` (chunked, full), ``relative`` (``loss``, ``hidden_grad``,
        ``head_grads``: max |chunked - full| / max |full|), ``head_parameters``, ``tolerance``.
        The model's gradients are restored.
    """
    line = enable_chunked_loss(runner)  # idempotent: the line ValidatedRoPEHook logged
    llm = runner.model.llm
    if not is_chunked(llm):
        return {"startup": line, "compared": False}
    head = chunked_loss_head(causal_lm(llm))[0]
    named = [(n, p) for n, p in head.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    held = [p.grad for p in params]
    try:
        chunked = _loss_and_grads(runner, data_batch, hooks, params)
        resume = pause_chunked_loss(llm)
        try:
            full = _loss_and_grads(runner, data_batch, hooks, params)
        finally:
            resume()
    finally:
        for p, g in zip(params, held):
            p.grad = g
    heads = [_relative(c, f) for c, f in zip(chunked["head"], full["head"])]
    return {
        "startup": line,
        "compared": True,
        "loss": {"chunked": chunked["loss"], "full": full["loss"]},
        "relative": {
            "loss": abs(chunked["loss"] - full["loss"]) / max(abs(full["loss"]), 1e-30),
            "hidden_grad": _relative(chunked["hidden"], full["hidden"]),
            "head_grads": max(heads, default=0.0),
        },
        "head_parameters": [n for n, _ in named],
        "tolerance": tolerance,
    }


def chunked_loss_problems(fig: dict | None) -> list[str]:
    """A problem for each relative difference beyond the tolerance."""
    if not fig or not fig["compared"]:
        return []
    return [
        f"chunked loss: its {name.replace('_', ' ')} differs from the full-logits loss's by "
        f"{rel:.3g} (relative, tolerance {fig['tolerance']:.3g}); train with chunked_loss = "
        "False and report the figures"
        for name, rel in fig["relative"].items()
        if not rel <= fig["tolerance"]  # NaN too
    ]


def chunked_loss_lines(fig: dict | None) -> list[str]:
    """The summary line: the three relative differences, or which loss runs and why."""
    if not fig:
        return []
    if not fig["compared"]:
        return [f"  chunked  not compared: {fig['startup'].removeprefix('xtuner-rope: ')}"]
    rel = fig["relative"]
    ok = "ok" if not chunked_loss_problems(fig) else "FAIL"
    return [
        f"  chunked  loss {fig['loss']['chunked']:.6f} vs full logits {fig['loss']['full']:.6f}:"
        f" relative {rel['loss']:.3g}; gradients hidden {rel['hidden_grad']:.3g}, head "
        f"{rel['head_grads']:.3g} (tolerance {fig['tolerance']:.3g})  {ok}"
    ]
