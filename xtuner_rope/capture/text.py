"""Isolation measured inside a real ``xtuner train`` run: capture iteration 1, compare offline.

:class:`IsolationCaptureHook` saves the first batch and its logits and loss;
:func:`compare_capture` runs each document alone through the unpatched model.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from mmengine.config import Config
from torch import nn

from xtuner_rope.capture import measure as cm
from xtuner_rope.capture.base import CaptureHook
from xtuner_rope.config.fields import offline_packs
from xtuner_rope.models.chunked_loss import pause_chunked_loss
from xtuner_rope.models.dispatch import language_model

CAPTURE_FILE = "isolation_capture.pt"


def _copy(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return value.detach().clone().cpu()
    if isinstance(value, (list, tuple)):
        return [_copy(v) for v in value]
    return value


class IsolationCaptureHook(CaptureHook):
    """Save the first training batch and the logits/loss the model computed from it (tiny models)
    in ``isolation_capture.pt`` (``{'data', 'logits': [b, s, V] fp32, 'loss', 'dtype'}``)."""

    def __init__(self) -> None:
        super().__init__(at_iter=0)
        self._data: dict | None = None
        self._out: dict = {}

    def _collect(self, module, args, output) -> None:
        if "logits" not in self._out and module.training:
            self._out["logits"] = output.logits.detach().float().cpu()
            self._out["loss"] = float(output.loss.detach())
            # the weights' dtype (a bf16 run rounds its logits: see compare_capture)
            self._out["dtype"] = str(next(module.parameters()).dtype).removeprefix("torch.")

    def install(self, runner, data_batch: dict) -> None:
        self._data = {k: _copy(v) for k, v in data_batch["data"].items()}
        llm = language_model(runner.model)
        self.on_undo(pause_chunked_loss(llm))  # the training forward's logits, for this step
        self.on_undo(llm.register_forward_hook(self._collect).remove)

    def saved(self, runner, outputs: dict | None) -> dict:
        return {"data": self._data, **self._out}

    def file_name(self) -> str:
        return CAPTURE_FILE

    def message(self, path: Path, saved: dict) -> str:
        return f"saved iteration 1's batch and logits to {path}."


def reference_llm(cfg: Config) -> nn.Module:
    """The config's ``llm`` as ``from_pretrained`` loads it: unpatched, fp32, on the CPU."""
    from xtuner.registry import BUILDER

    llm = BUILDER.build(cfg.model.llm)
    return llm.float().train()


def _pack_boundaries(cfg: Config, data: dict) -> list[list[int]]:
    """Boundaries of stock XTuner packs: the dataset rebuilt with ``use_varlen_attn=True``
    (``ValueError`` if a row matches none)."""
    from xtuner.registry import BUILDER

    dataset_cfg = copy.deepcopy(cfg.train_dataloader.dataset)
    if not offline_packs(dataset_cfg):  # build_packed_dataset records them always
        dataset_cfg["use_varlen_attn"] = True
    packs = {
        tuple(p["input_ids"]): [int(c) for c in p["cumulative_len"]]
        for p in BUILDER.build(dataset_cfg)
    }
    mask = data.get("attention_mask")
    rows = []
    for r, row in enumerate(data["input_ids"]):
        n = int(mask[r].sum()) if mask is not None else len(row)
        key = tuple(row[:n].tolist())
        if key not in packs:
            raise ValueError(
                f"compare_capture: captured row {r} matches no pack of the dataset "
                "rebuilt with use_varlen_attn=True; set train_dataloader.dataset."
                "shuffle_before_pack=False (packs differ from run to run)."
            )
        rows.append(packs[key])
    return rows


# Dataset builders that never pack: one document an item (MOSS's tokenized dialogues).
UNPACKED_BUILDERS = ("MOSSSFTDataset",)


def packs_documents(dataset_cfg: dict) -> bool:
    """Whether a dataset config packs documents into rows (``pack_to_max_length`` defaults to
    True)."""
    kind = dataset_cfg.get("type")
    name = getattr(kind, "__name__", str(kind)).rsplit(".", 1)[-1]
    if name == "ConcatDataset":
        return any(packs_documents(d) for d in dataset_cfg.get("datasets", []))
    if name in UNPACKED_BUILDERS:
        return False
    return bool(dataset_cfg.get("pack_to_max_length", True))


def compare_capture(config: str | Path, capture: str | Path) -> dict:
    """Each document of ``capture`` (:class:`IsolationCaptureHook`'s file) against the same
    document alone (unpatched, fp32), the trained ``config`` started as ``xtuner train`` does.

    Returns:
        ``{'documents', 'boundaries', 'dtype', 'max_abs_diff', 'per_document', 'loss'}``;
        ``dtype`` is the run's (judge with its tolerance).
    """
    from xtuner_rope.doctor.diagnose import start_like_xtuner_train

    saved = torch.load(capture, map_location="cpu", weights_only=False)
    data = saved["data"]
    cfg, _, _ = start_like_xtuner_train(str(config))  # the start-up's fixes, as trained
    unpacked = not packs_documents(cfg.train_dataloader.dataset)  # one document a row
    recorded = (
        None if data.get("cumulative_len") is not None or unpacked else _pack_boundaries(cfg, data)
    )
    docs, source = cm.documents(data, recorded, max_documents=10**9)  # nothing is cut
    n_packed, _ = cm.label_count(data["labels"], docs)
    logits, loss = cm.documents_alone(reference_llm(cfg), data, docs, n_packed, backward=False)
    per_doc = cm.logits_differences(saved["logits"], logits, docs)
    return {
        "documents": len(docs),
        "boundaries": source,
        "dtype": saved.get("dtype", "float32"),
        "max_abs_diff": max(d["max_abs_diff"] for d in per_doc),
        "per_document": per_doc,
        "loss": {"captured": saved["loss"], "documents": loss},
    }
