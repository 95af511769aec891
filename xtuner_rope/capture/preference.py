"""Isolation of packed preference pairs, measured inside a real ``xtuner train`` run.

:class:`PreferenceCaptureHook` (opt-in) saves one DPO/ORPO/reward batch, the step's weights and
the per-response values; :func:`compare_preference_capture` runs each response alone through
the unpatched model (float64 sums), and the packed row unpatched as a negative control.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from mmengine.config import Config
from mmengine.dist import get_rank, get_world_size
from torch import nn

from xtuner_rope.capture.base import CaptureHook
from xtuner_rope.capture.preference_losses import (
    dpo_sigmoid_loss,
    orpo_loss,
    response_logp,
    reward_loss,
)
from xtuner_rope.capture.randomness import randomness_off
from xtuner_rope.capture.text import reference_llm
from xtuner_rope.capture.weights import plain_state_dict
from xtuner_rope.evaluation.preference_metric import preference_kind
from xtuner_rope.models.dispatch import unwrap_model
from xtuner_rope.models.rope_documents import reset_upstream_rotaries

PREFERENCE_CAPTURE_FILE = "preference_capture.pt"
IGNORE = -100


def capture_file(rank: int = 0, world_size: int = 1) -> str:
    """The capture's file name: one per rank when several processes train."""
    return (
        PREFERENCE_CAPTURE_FILE
        if world_size == 1
        else PREFERENCE_CAPTURE_FILE.replace(".pt", f"_rank{rank}.pt")
    )


def _cpu(state: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    return {prefix + k: v.detach().float().cpu().clone() for k, v in state.items()}


def _lora_dpo_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """A LoRA DPO's policy (adapter merged, ``llm.``) and reference (adapter removed,
    ``ref_llm.``) as plain models: XTuner's state_dict holds the adapter only."""
    state = {}
    for prefix, undo in (("llm.", "merge_and_unload"), ("ref_llm.", "unload")):
        state.update(_cpu(getattr(copy.deepcopy(model.llm), undo)().state_dict(), prefix))
    return state


def _lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """A LoRA preference model as a plain ``llm.`` (adapter merged) and its other parts."""
    state = _cpu(copy.deepcopy(model.llm).merge_and_unload().state_dict(), "llm.")
    for name, part in model.named_children():
        if name != "llm":  # a reward model's v_head; a (plain) ZeRO-3 DPO reference
            state.update(_cpu(part.state_dict(), f"{name}."))
    return state


class PreferenceCaptureHook(CaptureHook):
    """Save one preference batch, the weights and the per-response values computed.

    Writes ``preference_capture[_rank{r}].pt`` after iteration ``at_iter + 1``: ``{'kind',
    'data', 'state_dict', 'values': {name: [pairs] fp32}, 'loss', 'randomness_off'}``; the
    step runs with dropout and router noise off (:func:`randomness_off`). Tiny models only; an
    ``at_iter`` after an optimizer step makes the policy and reference (and a zero reward head)
    differ.
    """

    def __init__(self, at_iter: int = 2) -> None:
        super().__init__(at_iter=at_iter)
        self._saved: dict | None = None

    def _record(self, name: str, values) -> None:
        for key, value in zip(name.split(","), values):
            self._saved["values"][key] = value.detach().float().cpu().reshape(-1)

    def _wrap_logps(self, model: nn.Module, names: str) -> None:
        # packed pairs (varlen): per response from the boundaries; unpacked: one row each
        method = "get_var_len_atten_logps" if model.use_varlen_attn else "get_logps"
        original = getattr(model, method)

        def recorded(*args, **kwargs):
            out = original(*args, **kwargs)
            self._record(names, out)
            return out

        setattr(model, method, recorded)
        self.on_undo(lambda: model.__dict__.pop(method, None))

    def _hook_reward_head(self, model: nn.Module, labels: torch.Tensor) -> None:
        def collect(module, args, output) -> None:
            scores = output.detach().float().cpu()[..., 0]  # [b, s]: 1 packed row or 2 per pair
            self._record("chosen,rejected", (scores[labels == 0], scores[labels == 1]))
            # [pairs * 2, h]: the reward tokens' hidden states, in row order
            self._saved["hidden"] = args[0].detach().float().cpu()[labels != IGNORE]

        self.on_undo(model.v_head.register_forward_hook(collect).remove)

    def install(self, runner, data_batch: dict) -> None:
        model = unwrap_model(runner.model)
        kind = preference_kind(model)
        if kind is None:
            raise TypeError(f"{type(model).__name__} is not XTuner's DPO, ORPO or RewardModel")
        data = {
            k: copy.deepcopy(v.detach().cpu() if isinstance(v, torch.Tensor) else v)
            for k, v in data_batch["data"].items()
        }
        lora = hasattr(model.llm, "merge_and_unload")  # a peft model: its adapter is trained
        if kind == "dpo" and model.ref_llm is None:
            state = _lora_dpo_state_dict(model)
        else:
            state = _lora_state_dict(model) if lora else plain_state_dict(model)
        self._saved = {
            "kind": kind,
            "data": data,
            "state_dict": state,
            "values": {},
            "world_size": get_world_size(),
        }
        # The alone passes run without dropout: so does the captured step (a LoRA policy's
        # lora_dropout=0.1 would otherwise differ by ~1e-3 in its summed log-probs).
        quiet = randomness_off(model)
        self._saved["randomness_off"] = quiet.__enter__()
        self.on_undo(lambda: quiet.__exit__(None, None, None))
        if kind == "dpo":
            self._wrap_logps(
                model, "policy_chosen,policy_rejected,reference_chosen,reference_rejected"
            )
        elif kind == "orpo":
            self._wrap_logps(model, "chosen,rejected")
        else:
            self._hook_reward_head(model, data["labels"])

    def saved(self, runner, outputs: dict | None) -> dict:
        saved, self._saved = self._saved, None
        loss = (outputs or {}).get("loss")
        saved["loss"] = float(loss) if loss is not None else None
        return saved

    def file_name(self) -> str:
        return capture_file(get_rank(), get_world_size())

    def message(self, path: Path, saved: dict) -> str:
        return (
            f"saved iteration {self.at_iter + 1}'s batch, weights and per-response values "
            f"to {path}."
        )


def _segments(data: dict) -> list[tuple[int, int, int]]:
    """``(row, start, end)`` of each captured response, in order: chosen, rejected, ...
    (packed: row 0 between its ``cumulative_len``; unpacked: row ``r`` up to its mask)."""
    cumulative = data.get("cumulative_len")
    if cumulative is None:
        lengths = data["attention_mask"].sum(-1).tolist()
        return [(r, 0, int(n)) for r, n in enumerate(lengths)]
    cumulative = cumulative[0] if isinstance(cumulative, (list, tuple)) else cumulative
    bounds = [int(c) for c in cumulative]
    return [(0, a, b) for a, b in zip(bounds[:-1], bounds[1:])]


def is_packed(data: dict) -> bool:
    """Whether the captured batch packs pairs into a row (boundaries recorded)."""
    return data.get("cumulative_len") is not None


def _llm_with(cfg: Config, state: dict, prefix: str) -> nn.Module:
    """The config's LLM, unpatched, fp32, with the captured weights under ``prefix``."""
    llm = reference_llm(cfg).eval()
    weights = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
    target = (
        llm if prefix != "llm." or any(k.startswith("model.") for k in weights) else llm.model
    )  # RewardModel keeps the base model (no LM head) as .llm
    target.load_state_dict(weights)
    return llm


@torch.no_grad()
def _values(
    llm: nn.Module, data: dict, kind: str, head: torch.Tensor | None, packed: bool
) -> tuple[list[float], torch.Tensor | None]:
    """Per response: its log-prob (DPO/ORPO) or reward score, alone or from the packed row.

    Returns:
        The values, and for a reward model the ``[responses, h]`` float64 hidden states at
        the reward tokens (None otherwise).
    """
    ids, labels = data["input_ids"], data["labels"]
    segments = _segments(data)

    def run(**inputs) -> torch.Tensor:  # hidden states for the reward head, else logits
        reset_upstream_rotaries(llm)  # dynamic NTK is stateful upstream: each as loaded
        return llm.model(**inputs)[0] if head is not None else llm(**inputs).logits

    if packed:  # the leak: one causal range over the row, positions restarting per response
        row = run(input_ids=ids, position_ids=data["position_ids"])
        outs = [row[r, a:b] for r, a, b in segments]
    else:
        outs = [run(input_ids=ids[r : r + 1, a:b])[0] for r, a, b in segments]
    if head is not None:  # reward score at the response's reward token
        hidden = torch.cat(
            [out[labels[r, a:b] != IGNORE].double() for out, (r, a, b) in zip(outs, segments)]
        )
        return (hidden @ head.double().T).reshape(-1).tolist(), hidden
    return [
        response_logp(out, labels[r, a:b], average=kind == "orpo")
        for out, (r, a, b) in zip(outs, segments)
    ], None


def _loss_alone(cfg: Config, kind: str, alone: dict, data: dict) -> float | None:
    """The model's loss recomputed from the responses alone (None: a loss type not covered)."""
    model = cfg.model
    if kind == "dpo":
        return (
            dpo_sigmoid_loss(alone, model.get("beta", 0.1), model.get("label_smoothing", 0.0))
            if model.get("loss_type", "sigmoid") == "sigmoid"
            else None
        )
    if kind == "orpo":
        labels = data["labels"]
        counts = [int((labels[r, a + 1 : b] != IGNORE).sum()) for r, a, b in _segments(data)]
        return orpo_loss(alone, counts[::2], model.get("beta", 0.1))
    return reward_loss(
        alone,
        model.get("loss_type", "ranking"),
        model.get("penalty_type", "log_barrier"),
        model.get("penalty_weight", 0.01),
    )


def _differences(captured: dict, expected: dict) -> dict:
    return {
        name: max(abs(float(c) - e) for c, e in zip(captured[name], expected[name]))
        for name in captured
    }


def compare_preference_capture(config: str | Path | Config, capture: str | Path) -> dict:
    """Captured per-response values (:class:`PreferenceCaptureHook`'s file) against each response
    alone (unpatched, float64 sums); ``config``: the trained config or its file.

    Returns:
        ``{'kind', 'packed', 'pairs', 'alone', 'captured', 'max_abs_diff',
        'leak_max_abs_diff', 'reward_token_states', 'loss'}``: values per name, run vs alone
        and unpatched packed row vs alone (empty unpacked); the reward head's input states the
        same; the logged loss and the one from the responses alone (reward: one process).
    """
    saved = torch.load(capture, map_location="cpu", weights_only=False)
    cfg = config if isinstance(config, Config) else Config.fromfile(str(config))
    kind, data, state = saved["kind"], saved["data"], saved["state_dict"]
    models = (
        {"policy_": _llm_with(cfg, state, "llm."), "reference_": _llm_with(cfg, state, "ref_llm.")}
        if kind == "dpo"
        else {"": _llm_with(cfg, state, "llm.")}
    )
    head = state.get("v_head.weight") if kind == "reward" else None
    alone, leak, hidden = {}, {}, {}
    runs = ((False, alone), (True, leak)) if is_packed(data) else ((False, alone),)
    for prefix, llm in models.items():
        for packed, out in runs:
            values, hidden[packed] = _values(llm, data, kind, head, packed)
            out[f"{prefix}chosen"], out[f"{prefix}rejected"] = values[::2], values[1::2]
    captured = {k: v.tolist() for k, v in saved["values"].items()}
    loss = {"captured": saved.get("loss")}
    if kind != "reward" or saved.get("world_size", 1) == 1:  # reward: averaged over processes
        alone_loss = _loss_alone(cfg, kind, alone, data)
        if alone_loss is not None and loss["captured"] is not None:
            loss["alone"] = alone_loss
    states = {}
    if kind == "reward":  # the head starts at zero: the states it reads tell more early on
        states = {
            "max_abs_diff": float((saved["hidden"] - hidden[False]).abs().max()),
            "max_abs": float(hidden[False].abs().max()),
            "leak_max_abs_diff": float((hidden[True] - hidden[False]).abs().max())
            if True in hidden
            else None,
        }
    return {
        "kind": kind,
        "packed": is_packed(data),
        "pairs": len(alone[next(iter(alone))]),
        "alone": alone,
        "reward_token_states": states,
        "captured": captured,
        "max_abs_diff": _differences(captured, alone),
        "leak_max_abs_diff": _differences(leak, alone),
        "loss": loss,
    }
