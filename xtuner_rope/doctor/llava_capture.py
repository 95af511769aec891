"""Isolation inside a real LLaVA ``xtuner train`` run: capture what the LLM saw, compare offline.

In a LLaVA model the LLM never sees the batch the collate function made: ``LLaVAModel``
expands each image placeholder into patch embeddings first. :class:`LLaVAIsolationCaptureHook`
(opt-in: ``dict(type=LLaVAIsolationCaptureHook)`` in ``custom_hooks``) therefore records the
LLM's own inputs of iteration 1 (``inputs_embeds`` ``[b, s, d]``, ``attention_mask``,
``position_ids``, ``labels``) and its logits and loss, to ``<work_dir>/llava_isolation_capture.pt``.
:func:`compare_llava_capture` runs each sample alone (its real tokens, positions ``0..n-1``;
a packed row's samples are cut where its positions restart)
through the config's LLM loaded fresh from its checkpoint in fp32, unpatched: 0 up to
rounding when the run kept each sample to itself.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from mmengine.config import Config
from mmengine.hooks import Hook
from mmengine.logging import print_log
from torch import nn

LLAVA_CAPTURE_FILE = "llava_isolation_capture.pt"
_FIELDS = ("inputs_embeds", "attention_mask", "position_ids", "labels")
IGNORE_INDEX = -100


def inner_llm(model: nn.Module) -> nn.Module:
    """The HF LLM inside DDP/DeepSpeed wrappers and XTuner's ``LLaVAModel`` (``.llm``)."""
    while hasattr(model, "module") and isinstance(model.module, nn.Module):
        model = model.module
    return getattr(model, "llm", model)


class LLaVAIsolationCaptureHook(Hook):
    """Save the LLM's inputs, logits and loss of the first training step of a LLaVA run.

    For tiny test models: the saved logits are ``[b, s, V]`` fp32.
    """

    # After ValidatedRoPEHook (5), before PackedBatchCheckHook (8).
    priority = 7

    def __init__(self) -> None:
        self._saved: dict = {}
        self._handle = None

    def _collect(self, module, args, kwargs, output) -> None:
        if self._saved or not module.training:
            return
        self._saved = {k: (v.detach().float().cpu() if k == "inputs_embeds" else v.cpu())
                       for k, v in kwargs.items() if k in _FIELDS and v is not None}
        self._saved["logits"] = output.logits.detach().float().cpu()
        self._saved["loss"] = float(output.loss.detach())

    def before_train_iter(self, runner, batch_idx: int, data_batch=None) -> None:
        if runner.iter == 0:
            self._handle = inner_llm(runner.model).register_forward_hook(
                self._collect, with_kwargs=True)

    def after_train_iter(self, runner, batch_idx: int, data_batch=None, outputs=None) -> None:
        if self._handle is None:
            return
        self._handle.remove()
        self._handle = None
        path = Path(runner.work_dir) / LLAVA_CAPTURE_FILE
        torch.save(self._saved, path)
        print_log(f"LLaVAIsolationCaptureHook: saved iteration 1's LLM inputs and logits to "
                  f"{path}.", logger="current")


def reference_llava_llm(cfg: Config) -> nn.Module:
    """The config's LLM as ``from_pretrained`` loads it in fp32, unpatched, on the CPU."""
    from xtuner.registry import BUILDER

    llm_cfg = dict(cfg.model.llm)
    llm_cfg["torch_dtype"] = torch.float32  # the run loads fp32 on CPU (start-up switch)
    return BUILDER.build(llm_cfg).float().train()


def _samples(lengths: list[int], positions: torch.Tensor | None):
    """(row, start, length) of each sample: a row's real tokens, cut where positions restart
    at 0 (rows packed by ``llava_collate_fn``; a padded row is one sample)."""
    for r, n in enumerate(lengths):
        starts = [0] if positions is None else \
            [int(c) for c in (positions[r, :n] == 0).nonzero().reshape(-1)] or [0]
        for a, e in zip(starts, starts[1:] + [n]):
            yield r, a, e - a


def compare_llava_capture(config: str | Path, capture: str | Path) -> dict:
    """Each captured sample's LLM logits against the same sample alone (unpatched, fp32).

    Args:
        config: The config that was trained (its LLM is loaded from its path).
        capture: The file written by :class:`LLaVAIsolationCaptureHook`.

    Returns:
        ``{'samples', 'max_abs_diff', 'per_sample': [{'tokens', 'max_abs_diff',
        'max_abs_logit'}], 'loss': {'captured', 'samples'}}``.
    """
    saved = torch.load(capture, map_location="cpu", weights_only=False)
    embeds, logits = saved["inputs_embeds"], saved["logits"]
    b, s = embeds.shape[:2]
    mask = saved.get("attention_mask")
    lengths = mask.bool().sum(dim=1).tolist() if mask is not None else [s] * b
    positions = saved.get("position_ids")
    llm = reference_llava_llm(Config.fromfile(str(config)))
    per_sample, loss_sum, count = [], 0.0, 0
    with torch.no_grad():
        for r, a, n in _samples(lengths, positions):
            alone = llm(inputs_embeds=embeds[r:r + 1, a:a + n],
                        position_ids=torch.arange(n)[None]).logits[0].float()
            per_sample.append({"tokens": n, "max_abs_logit": float(alone.abs().max()),
                               "max_abs_diff": float((logits[r, a:a + n] - alone).abs().max())})
            labels = saved["labels"][r, a:a + n]
            loss_sum += float(F.cross_entropy(alone[:-1], labels[1:], reduction="sum",
                                              ignore_index=IGNORE_INDEX))
            count += int((labels[1:] != IGNORE_INDEX).sum())
    return {"samples": len(per_sample), "max_abs_diff": max(d["max_abs_diff"] for d in per_sample),
            "per_sample": per_sample,
            "loss": {"captured": saved["loss"], "samples": loss_sum / max(count, 1)}}
