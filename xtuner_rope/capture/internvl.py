"""Isolation inside a real InternVL ``xtuner train`` run: capture what the LLM saw, compare.

:func:`compare_internvl_capture` (``python -m xtuner_rope.capture.internvl CONFIG CAPTURE``)
runs each captured sample alone through the unpatched LLM with the step's weights.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from mmengine.config import Config
from torch import nn

from xtuner_rope.capture.llava import LLMCaptureHook, isolation_figures
from xtuner_rope.capture.measure import IGNORE_INDEX
from xtuner_rope.models.chunked_loss import pause_chunked_loss
from xtuner_rope.models.dispatch import language_model

INTERNVL_CAPTURE_FILE = "internvl_isolation_capture.pt"
_INPUTS = ("inputs_embeds", "attention_mask", "position_ids")


def batch_loss(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """XTuner's InternVL loss: mean cross-entropy of the shifted labels over the batch."""
    return float(
        F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]),
            labels[:, 1:].reshape(-1),
            ignore_index=IGNORE_INDEX,
        )
    )


class InternVLIsolationCaptureHook(LLMCaptureHook):
    """Save the LLM's inputs, weights and logits of the first step of an InternVL run (tiny models)."""

    FILE, WHAT = INTERNVL_CAPTURE_FILE, "LLM inputs, weights and logits"

    def _collect(self, module, args, kwargs, output) -> None:
        if "logits" in self._saved or not module.training:
            return
        inputs = {k: kwargs[k].detach() for k in _INPUTS if kwargs.get(k) is not None}
        self._saved.update({k: v.float().cpu() for k, v in inputs.items()})
        self._saved["logits_train"] = output.logits.detach().float().cpu()
        with torch.no_grad():
            module.eval()
            try:
                self._saved["logits"] = module(**inputs).logits.float().cpu()
            finally:
                module.train()
        self._saved["loss"] = batch_loss(self._saved["logits"], self._saved["labels"])
        if self._reference is not None:
            with torch.no_grad():
                self._saved["unpatched_logits"] = self._reference(**inputs).logits.float().cpu()
            self._saved["in_run"] = isolation_figures(self._reference, self._saved)
            self._reference = None

    def install(self, runner, data_batch: dict) -> None:
        llm = language_model(runner.model)
        self._saved = {
            "labels": data_batch["data"]["labels"].cpu(),
            "input_ids": data_batch["data"]["input_ids"].cpu(),
            "llm_state": {k: v.detach().cpu().clone() for k, v in llm.state_dict().items()},
        }
        if self.negative_control:
            self._reference = reference_internvl_llm(runner.cfg)
            self._reference.load_state_dict(self._saved["llm_state"])
            self._reference.to(next(llm.parameters()).device).eval()
        self.on_undo(pause_chunked_loss(llm))  # the training forward's logits, for this step
        self.on_undo(llm.register_forward_hook(self._collect, with_kwargs=True).remove)


def reference_internvl_llm(cfg: Config) -> nn.Module:
    """The config's InternVL LLM built again by XTuner (LoRA as in the run), unpatched, fp32."""
    from xtuner.registry import BUILDER

    from xtuner_rope.compat.xtuner_internvl import INTERNVL_LOAD
    from xtuner_rope.config.internvl import internvl_findings

    kept = dict(INTERNVL_LOAD)
    try:
        for finding in internvl_findings(cfg):
            if finding.fix is not None:
                finding.fix()
        INTERNVL_LOAD["torch_dtype"] = torch.float32
        model = BUILDER.build(cfg.model)
    finally:
        INTERNVL_LOAD.clear()
        INTERNVL_LOAD.update(kept)
    return language_model(model).float().eval()


def compare_internvl_capture(config: str | Path, capture: str | Path) -> dict:
    """Each captured sample against itself alone, unpatched, with the step's weights
    (:func:`isolation_figures`)."""
    saved = torch.load(capture, map_location="cpu", weights_only=False)
    cfg = Config.fromfile(str(config))
    llm = reference_internvl_llm(cfg)
    llm.load_state_dict(saved["llm_state"])
    return isolation_figures(llm, saved)


if __name__ == "__main__":  # python -m xtuner_rope.capture.internvl CONFIG CAPTURE
    from xtuner_rope.compat import apply

    apply()  # a fresh process: the patches InternVL's load needs (importing patches nothing)
    result = compare_internvl_capture(sys.argv[1], sys.argv[2])
    print("INTERNVL_COMPARE=" + json.dumps(result))
