"""Replay a batch saved by ``NonFiniteTripwireHook`` and name where the first NaN/inf appeared.

:func:`replay` reruns the recorded forward (and backward) pass and reports the first
non-finite module output (or output gradient), with its row, document and token range.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from xtuner_rope.batch.record import load_record, save_record
from xtuner_rope.batch.stats import segment_ids
from xtuner_rope.models import channel

__all__ = ["Finding", "build_run_model", "load_record", "replay", "save_record"]


@dataclass
class Finding:
    """The first non-finite tensor of a replay and where it sits in the batch."""

    phase: str  # 'forward' (a module output) or 'backward' (the gradient of a module output)
    module: str  # qualified name in the model, '' for the model itself
    module_type: str
    kind: str  # 'nan' or 'inf'
    shape: list[int]
    row: int | None = None
    document: int | None = None  # index of the document within its row
    tokens: tuple[int, int] | None = None  # [start, end) columns of that document
    column: int | None = None  # first non-finite token
    documents: list[tuple[int, int]] = field(default_factory=list)  # every (row, document) hit

    def describe(self) -> str:
        what = "output" if self.phase == "forward" else "output gradient"
        text = (
            f"first non-finite value ({self.kind}): {self.phase} {what} of "
            f"{self.module or '<model>'} ({self.module_type}), shape {self.shape}"
        )
        if self.row is not None:
            text += (
                f"; row {self.row}, document {self.document}, tokens "
                f"[{self.tokens[0]}, {self.tokens[1]}), first bad token at column "
                f"{self.column}; documents hit (row, document): {self.documents}"
            )
        return text


def _token_layout(t: torch.Tensor, b: int, s: int) -> torch.Tensor | None:
    """``[b, s]`` bool of tokens with a non-finite value in ``t``, for known layouts."""
    bad = ~torch.isfinite(t.detach())
    if t.dim() >= 2 and tuple(t.shape[:2]) == (b, s):  # [b, s, ...]
        return bad.reshape(b, s, -1).any(-1)
    if t.dim() >= 3 and t.shape[0] == b and t.shape[2] == s:  # [b, n_h, s, ...]
        return bad.transpose(1, 2).reshape(b, s, -1).any(-1)
    if t.dim() >= 1 and t.shape[0] == b * s:  # [b * s, ...] (flattened varlen)
        return bad.reshape(b, s, -1).any(-1)
    return None


def _finding(phase: str, name: str, module: nn.Module, t: torch.Tensor, data: dict) -> Finding:
    b, s = data["input_ids"].shape
    kind = "nan" if bool(torch.isnan(t).any()) else "inf"
    found = Finding(phase, name, type(module).__name__, kind, list(t.shape))
    tokens = _token_layout(t, b, s)
    if tokens is None or not bool(tokens.any()):
        return found
    seg = segment_ids(data.get("position_ids"), (b, s), data.get("attention_mask"))
    first_seg = seg[:, :1]
    hits = sorted({(r, int(seg[r, c] - first_seg[r])) for r, c in tokens.nonzero().tolist()})
    r, c = tokens.nonzero()[0].tolist()
    cols = (seg[r] == seg[r, c]).nonzero().reshape(-1)
    found.row, found.column, found.documents = r, c, hits
    found.document = int(seg[r, c] - first_seg[r])
    found.tokens = (int(cols[0]), int(cols[-1]) + 1)
    return found


def _tensors(output) -> list[torch.Tensor]:
    """Floating tensors of a module output (tensor, tuple/list, dict or HF ``ModelOutput``)."""
    if isinstance(output, torch.Tensor):
        return [output] if output.is_floating_point() else []
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in _tensors(item)]
    return []


def _watch(model: nn.Module, data: dict, found: list[Finding]) -> list:
    """Forward hooks on every module recording the first non-finite output and output grad."""

    def on_forward(name, module, _args, output):
        for t in _tensors(output):
            if not found and not bool(torch.isfinite(t.detach()).all()):
                found.append(_finding("forward", name, module, t, data))
            if t.requires_grad:
                t.register_hook(lambda g, name=name, module=module: on_backward(name, module, g))

    def on_backward(name, module, grad):
        if not found and not bool(torch.isfinite(grad).all()):
            found.append(_finding("backward", name, module, grad, data))

    return [
        m.register_forward_hook(lambda mod, a, o, name=name: on_forward(name, mod, a, o))
        for name, m in model.named_modules()
    ]


def replay(model: nn.Module, record: dict) -> Finding | None:
    """Run the recorded batch through ``model`` (the recorded weights loaded, patched as in the
    run), forward then backward: the first non-finite module output, else output gradient
    (backward order), else None.
    """
    device = next(model.parameters()).device
    data = {k: v.to(device) for k, v in record["data"].items()}
    varlen = record.get("varlen") or {}
    cumulative = varlen.get("cumulative_len")
    channel.publish(
        None if cumulative is None else cumulative.to(device), varlen.get("max_seqlen"), rank=0
    )
    found: list[Finding] = []
    handles = _watch(model, record["data"], found)
    try:
        model.train()
        losses = model(data, mode="loss")  # XTuner's SupervisedFinetune.forward(data, ...)
        loss = sum(v.sum() for k, v in losses.items() if "loss" in k)
        if not found and not bool(torch.isfinite(loss)):
            found.append(
                Finding("forward", "loss", "loss", "nan" if bool(torch.isnan(loss)) else "inf", [])
            )
        if not found:
            loss.backward()
    finally:
        for handle in handles:
            handle.remove()
        channel.clear(rank=0)
    return found[0] if found else None


def build_run_model(
    config: str | Path,
    record: dict,
    checkpoint: str | Path | None = None,
    cfg_options: dict | None = None,
) -> nn.Module:
    """The run's model, built from its config, with the weights it had when the batch failed.

    Args:
        record: from :func:`load_record`; its ``weights`` file is loaded unless ``checkpoint``
            (an ``iter_N.pth``) is given.

    Raises:
        ValueError: no weights to load (the run saved none and no checkpoint was given).
    """
    from mmengine.config import Config
    from mmengine.registry import MODELS
    from xtuner.tools.utils import set_model_resource

    from xtuner_rope.checkpoints.loading import load_checkpoint
    from xtuner_rope.models.internlm2 import patch_internlm2_attention

    weights = checkpoint or record.get("weights")
    if weights is None:
        raise ValueError(
            "build_run_model: the batch file names no weights file (the run had "
            "save_weights=False); pass --checkpoint with the checkpoint to replay."
        )
    cfg = Config.fromfile(str(config))
    if cfg_options:
        cfg.merge_from_dict(cfg_options)
    set_model_resource(cfg)  # as `xtuner train` does (builds a missing tiny checkpoint)
    model = MODELS.build(cfg.model)
    if checkpoint:  # a runner checkpoint: weights-only, with the runner's own types allowed
        state = load_checkpoint(str(checkpoint))
    else:
        state = torch.load(weights, map_location="cpu", weights_only=True)
    model.load_state_dict(state.get("state_dict", state) if checkpoint else state)
    if record.get("isolating"):
        patch_internlm2_attention(model)  # what the run's ValidatedRoPEHook did
    return model
