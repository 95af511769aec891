"""Isolation inside a real LLaVA ``xtuner train`` run: capture what the LLM saw, compare offline.

:class:`LLaVAIsolationCaptureHook` records the LLM's (expanded) inputs, logits and loss of
iteration 1; :func:`compare_llava_capture` runs each sample alone through the unpatched LLM.
"""

from __future__ import annotations

from pathlib import Path

import torch
from mmengine.config import Config
from torch import nn

from xtuner_rope.capture import measure as cm
from xtuner_rope.capture.base import CaptureHook
from xtuner_rope.capture.randomness import randomness_off
from xtuner_rope.capture.weights import plain_state_dict, plain_weights_refusal
from xtuner_rope.models.chunked_loss import pause_chunked_loss
from xtuner_rope.models.dispatch import language_model
from xtuner_rope.models.rope_documents import reset_upstream_rotaries

LLAVA_CAPTURE_FILE = "llava_isolation_capture.pt"
_FIELDS = ("inputs_embeds", "attention_mask", "position_ids", "labels")


class LLMCaptureHook(CaptureHook):
    """Base of the multimodal captures: the LLM's first step, with an in-run negative control
    (``negative_control``: an unpatched copy of the LLM with the run's weights measured too,
    :func:`isolation_figures`, logged)."""

    FILE = WHAT = ""  # the capture's file name; what the log line says was saved

    def __init__(self, negative_control: bool = True) -> None:
        super().__init__(at_iter=0)
        self.negative_control = negative_control
        self._saved: dict = {}
        self._reference: nn.Module | None = None

    def saved(self, runner, outputs: dict | None) -> dict:
        return self._saved

    def file_name(self) -> str:
        return self.FILE

    def message(self, path: Path, saved: dict) -> str:
        measured = in_run_sentence(saved.get("in_run"))
        return f"saved iteration 1's {self.WHAT} to {path}.{measured}"


class LLaVAIsolationCaptureHook(LLMCaptureHook):
    """Save the LLM's inputs, logits and loss of the first step of a LLaVA run (tiny models),
    dropout off; the negative control merges LoRA, gathers ZeRO-3 (refuses LoRA under ZeRO-3)."""

    FILE, WHAT = LLAVA_CAPTURE_FILE, "LLM inputs and logits"

    def before_train(self, runner) -> None:
        """Refuse, before any step, a negative control this LLM cannot have."""
        refusal = self.negative_control and plain_weights_refusal(
            language_model(runner.model), type(self).__name__
        )
        if refusal:
            raise ValueError(refusal)

    def _collect(self, module, args, kwargs, output) -> None:
        if self._saved or not module.training:
            return
        self._saved = {
            k: (v.detach().float().cpu() if k == "inputs_embeds" else v.cpu())
            for k, v in kwargs.items()
            if k in _FIELDS and v is not None
        }
        self._saved["logits"] = output.logits.detach().float().cpu()
        self._saved["loss"] = float(output.loss.detach())
        if self._reference is not None:
            inputs = {
                k: v.detach()
                for k, v in kwargs.items()
                if k in _FIELDS and k != "labels" and v is not None
            }
            self._reference.train(module.training)
            with torch.no_grad():
                unpatched = self._reference(**inputs).logits.float().cpu()
            self._saved["unpatched_logits"] = unpatched
            self._saved["in_run"] = isolation_figures(self._reference, self._saved)
            self._reference = None

    def install(self, runner, data_batch: dict) -> None:
        llm = language_model(runner.model)
        if self.negative_control:
            self._reference = reference_llava_llm(runner.cfg)
            # The weights of this step, LoRA merged / ZeRO-3 gathered.
            self._reference.load_state_dict(plain_state_dict(llm))
            self._reference.to(next(llm.parameters()).device)
        # LoRA's lora_dropout would make the step differ from the reference passes.
        quiet = randomness_off(llm)
        quiet.__enter__()
        self.on_undo(lambda: quiet.__exit__(None, None, None))
        self.on_undo(pause_chunked_loss(llm))  # the training forward's logits, for this step
        self.on_undo(llm.register_forward_hook(self._collect, with_kwargs=True).remove)


def in_run_sentence(figures: dict | None) -> str:
    """The log's sentence on :func:`isolation_figures` (``""`` without a negative control)."""
    if figures is None:
        return ""
    return (
        f" In the run, against each sample alone through the unpatched LLM: "
        f"{figures['samples']} samples in {figures['rows']} rows, max |trained - alone| "
        f"{figures['max_abs_diff']:.3g}; the same rows through the unpatched LLM "
        f"(negative control) {figures['unpatched_max_abs_diff']:.3g}."
    )


def reference_llava_llm(cfg: Config) -> nn.Module:
    """The config's LLM as ``from_pretrained`` loads it in fp32, unpatched, on the CPU."""
    from xtuner.registry import BUILDER

    llm_cfg = dict(cfg.model.llm)
    llm_cfg["torch_dtype"] = torch.float32  # the run loads fp32 on CPU (start-up switch)
    return BUILDER.build(llm_cfg).float().train()


def _samples(lengths: list[int], positions: torch.Tensor | None):
    """``(row, start, end)`` of each sample: a row's real tokens, cut where positions restart."""
    for r, n in enumerate(lengths):
        starts = (
            [0]
            if positions is None
            else [int(c) for c in (positions[r, :n] == 0).nonzero().reshape(-1)] or [0]
        )
        yield from ((r, a, e) for a, e in zip(starts, starts[1:] + [n]))


def isolation_figures(llm: nn.Module, saved: dict) -> dict:
    """Each captured sample against itself alone through ``llm`` (unpatched), fp32.

    Args:
        saved: The capture (``inputs_embeds`` ``[b, s, d]``, ``logits`` ``[b, s, V]``,
            ``attention_mask`` / ``position_ids`` / ``labels`` ``[b, s]``, optionally
            ``unpatched_logits`` ``[b, s, V]``).

    Returns:
        ``{'rows', 'samples', 'max_abs_diff', 'unpatched_max_abs_diff', 'per_sample': [...],
        'loss': {'captured', 'samples'}}``.
    """
    embeds, labels = saved["inputs_embeds"], saved["labels"]
    unpatched = saved.get("unpatched_logits")
    b, s = embeds.shape[:2]
    mask = saved.get("attention_mask")
    lengths = mask.bool().sum(dim=1).tolist() if mask is not None else [s] * b
    docs = list(_samples(lengths, saved.get("position_ids")))
    device = next(llm.parameters()).device
    alone = []
    with torch.no_grad():
        for r, a, e in docs:
            reset_upstream_rotaries(llm)  # dynamic NTK is stateful upstream: each as loaded
            positions = torch.arange(e - a, device=device)[None]  # [1, n]
            out = llm(inputs_embeds=embeds[r : r + 1, a:e].to(device), position_ids=positions)
            alone.append(out.logits[0].float().cpu())
    per_sample = cm.logits_differences(saved["logits"], alone, docs)
    leaks = cm.logits_differences(unpatched, alone, docs) if unpatched is not None else None
    for i, sample in enumerate(per_sample):
        sample["unpatched_max_abs_diff"] = leaks and leaks[i]["max_abs_diff"]
    loss = sum(float(cm.token_loss_sum(x, labels[r, a:e])) for x, (r, a, e) in zip(alone, docs))
    return {
        "rows": b,
        "samples": len(per_sample),
        "max_abs_diff": max(d["max_abs_diff"] for d in per_sample),
        "unpatched_max_abs_diff": leaks and max(d["max_abs_diff"] for d in leaks),
        "per_sample": per_sample,
        "loss": {
            "captured": saved["loss"],
            "samples": loss / max(cm.label_count(labels, docs)[1], 1),
        },
    }


def compare_llava_capture(config: str | Path, capture: str | Path) -> dict:
    """Each captured sample's LLM logits against the same sample alone (unpatched, fp32, offline):
    :func:`isolation_figures` of ``capture`` (:class:`LLaVAIsolationCaptureHook`'s file), the LLM
    loaded from the trained ``config``'s path.
    """
    saved = torch.load(capture, map_location="cpu", weights_only=False)
    return isolation_figures(reference_llava_llm(Config.fromfile(str(config))), saved)
