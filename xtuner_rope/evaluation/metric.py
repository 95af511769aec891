"""``TokenLossMetric``: the held-out loss that packing does not change, exact on any rank count.

``val_step`` (``mode='predict'``) gives per row ``logits`` ``[s, V]`` or ``target_logprobs``
``[s]`` (chunked loss); each row is cut at the published boundaries and each dialogue scored
whole and alone (``ops.token_nll.document_nll``). One result per dataset sample, so MMEngine's
``collect_results`` drops the sampler's repeats across ranks.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import torch
from mmengine.evaluator import BaseMetric
from mmengine.logging import print_log

from xtuner_rope.models import channel
from xtuner_rope.models.llava import flat_row_bounds
from xtuner_rope.ops.token_nll import document_nll

WORST_FILE = "heldout_worst.jsonl"  # in the run's work dir (set by HeldOutCurvesHook)
FIRST_TOKENS = 16  # tokens kept per dialogue for the worst-dialogues file's "first words"


def row_bounds(flat: torch.Tensor | None, b: int, s: int) -> list[torch.Tensor]:
    """Per-row ``[n_r + 1]`` boundaries from the channel's flat ``[n + 1]`` ones (or whole rows)."""
    if flat is None:
        return [torch.tensor([0, s]) for _ in range(b)]
    return flat_row_bounds(flat, b, s)


def row_documents(
    out: dict, labels: torch.Tensor, ids: torch.Tensor, bounds: torch.Tensor
) -> list[dict]:
    """Each segment of one row: summed NLL, supervised tokens, first ids (padding included).

    Args:
        out: The row's ``val_step`` output: ``logits`` ``[s', V]`` or ``target_logprobs``
            ``[s']``; a LLaVA model's also ``labels`` ``[s']`` (after the image expansion).
        labels: ``[s]`` the batch row's labels; ids: ``[s]`` its input ids.
        bounds: ``[n + 1]`` the segments of the sequence the logits cover.

    Returns:
        Per segment ``{'nll', 'tokens', 'first_ids'}`` (input ids, or for LLaVA the first
        supervised targets).
    """
    own = out.get("labels")
    row_labels = own if isinstance(own, torch.Tensor) else labels
    nll, tokens = document_nll(row_scores(out), row_labels, bounds)
    docs = []
    for d in range(len(tokens)):
        a, e = int(bounds[d]), int(bounds[d + 1])
        if own is None:
            first = ids[a : a + FIRST_TOKENS]
        else:
            segment = row_labels[a:e]
            first = segment[segment != -100][:FIRST_TOKENS]
        docs.append({"nll": float(nll[d]), "tokens": int(tokens[d]), "first_ids": first.tolist()})
    return docs


def row_scores(out: object, prefix: str = "") -> torch.Tensor | None:
    """A row output's ``<prefix>logits`` ``[s, V]`` or chunked ``<prefix>target_logprobs``
    ``[s]`` (``prefix``: DPO's ``ref_``), else None."""
    keys = (f"{prefix}target_logprobs", f"{prefix}logits")
    scores = out.get(keys[0], out.get(keys[1])) if isinstance(out, dict) else None
    return scores if isinstance(scores, torch.Tensor) else None


def per_sample_results(rows: list[list[dict]], plan: list[list[int]]) -> list[dict]:
    """One result per batch sample, in batch order, from rows packed by ``plan``
    (``data_samples['rows']`` of ``llava_collate_fn`` / ``internvl_collate_fn``).

    Raises:
        ValueError: a row has fewer segments than samples (packed rows without boundaries).
    """
    by_sample: dict[int, list[dict]] = {}
    for r, (docs, samples) in enumerate(zip(rows, plan)):
        if len(docs) < len(samples):
            raise ValueError(
                f"TokenLossMetric: held-out row {r} packs {len(samples)} samples but has "
                f"{len(docs)} segment(s): its boundaries were not published. Keep "
                "PackedBatchCheckHook in custom_hooks (the start-up adds it) and the patched "
                "model, or collate with pack=False."
            )
        for i, doc in zip(samples, docs):
            by_sample[i] = [doc] if doc["tokens"] > 0 else []
    return [{"documents": by_sample[i]} for i in sorted(by_sample)]


class TokenLossMetric(BaseMetric):
    """Token-weighted mean next-token NLL over every supervised token of the held-out set.

    Reports ``<name>_loss``, ``_ppl``, ``_tokens`` and ``_dialogues``; ``heldout_worst.jsonl``
    lists the ``worst`` dialogues (highest mean NLL) by their first words (``tokenizer`` or its
    XTuner config dict; None: token ids).
    """

    default_prefix = None

    def __init__(
        self,
        name: str = "heldout",
        tokenizer: object = None,
        worst: int = 20,
        collect_device: str = "cpu",
    ) -> None:
        super().__init__(collect_device=collect_device, prefix="")  # keys carry `name`
        self.name = name
        self.tokenizer = tokenizer
        self.worst = worst
        self.output_dir: str | None = None  # the work dir, set by HeldOutCurvesHook
        self.evaluations = 0

    def process(self, data_batch: dict, data_samples: Sequence[dict]) -> None:
        """Score each row's documents; one result per row, or per sample of a packed row.

        Args:
            data_batch: The collated batch: ``data`` holds ``input_ids``, ``labels`` ``[b, s]``.
            data_samples: ``val_step``'s output, ``b`` dicts (see :func:`row_documents`).

        Raises:
            TypeError: the model's ``val_step`` does not return per-row logits.
            ValueError: the batch has no labels, or rows and outputs disagree.
        """
        data = data_batch.get("data", data_batch) if isinstance(data_batch, dict) else None
        if not isinstance(data, dict) or "labels" not in data or "input_ids" not in data:
            raise ValueError(
                "TokenLossMetric: the held-out batch has no input_ids/labels (got "
                f"{sorted(data) if isinstance(data, dict) else type(data).__name__}); use an "
                "XTuner SFT dataset (process_hf_dataset) with default_collate_fn or rope_collate_fn."
            )
        ids, labels = data["input_ids"], data["labels"]
        b = labels.shape[0]
        if (
            not isinstance(data_samples, Sequence)
            or len(data_samples) != b
            or any(row_scores(x) is None for x in data_samples)
        ):
            got = (
                [type(x).__name__ for x in data_samples]
                if isinstance(data_samples, Sequence)
                else type(data_samples).__name__
            )
            raise TypeError(
                f"TokenLossMetric: model.val_step must return one dict with 'logits' [s, V] per "
                f"row ({b} rows), got {got}. It serves XTuner's SupervisedFinetune (full, LoRA), "
                "LLaVAModel and InternVL_V1_5; remove val_evaluator=dict(type=TokenLossMetric) "
                "for other models."
            )
        # The logits' length: LLaVA's rows are longer after the image expansion.
        bounds = row_bounds(channel.read()[0], b, row_scores(data_samples[0]).shape[0])
        rows = [
            row_documents(out, labels[r], ids[r], bounds[r]) for r, out in enumerate(data_samples)
        ]
        plan = data_batch.get("data_samples") if isinstance(data_batch, dict) else None
        plan = plan.get("rows") if isinstance(plan, dict) else None
        if plan is None:  # one dataset row per batch row (XTuner's collate, held-out packs)
            for docs in rows:
                self.results.append({"documents": [d for d in docs if d["tokens"] > 0]})
            return
        self.results += per_sample_results(rows, plan)

    def compute_metrics(self, results: list) -> dict:
        """Totals over the held-out set (results in dataset order, repeats already cut).

        Raises:
            ValueError: the held-out set has no supervised token.
        """
        docs = [doc for result in results for doc in result["documents"]]
        tokens = sum(doc["tokens"] for doc in docs)
        if tokens == 0:
            raise ValueError(
                f"TokenLossMetric: the held-out set ({len(results)} rows) has no supervised token "
                "(every label is -100): there is no loss to measure. Point val_dataloader at "
                "dialogues with answers (alpaca 'output', conversation 'output')."
            )
        loss = math.fsum(doc["nll"] for doc in docs) / tokens
        self.evaluations += 1
        self._write_worst(docs)
        return {
            f"{self.name}_loss": loss,
            f"{self.name}_ppl": math.exp(min(loss, 700.0)),
            f"{self.name}_tokens": tokens,
            f"{self.name}_dialogues": len(docs),
        }

    def _decode(self, ids: list) -> str:
        if self.tokenizer is None:
            return " ".join(map(str, ids))
        if isinstance(self.tokenizer, dict):
            from xtuner.registry import BUILDER

            self.tokenizer = BUILDER.build(self.tokenizer)
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _write_worst(self, docs: list[dict]) -> None:
        """The worst dialogues (highest mean NLL) of this evaluation, worst first."""
        if self.output_dir is None or self.worst <= 0:
            return
        order = sorted(range(len(docs)), key=lambda i: -docs[i]["nll"] / docs[i]["tokens"])
        path = Path(self.output_dir) / WORST_FILE
        with path.open("w", encoding="utf-8") as f:
            for i in order[: self.worst]:
                doc = docs[i]
                line = {
                    "evaluation": self.evaluations,
                    "dialogue_index": i,
                    "mean_nll": doc["nll"] / doc["tokens"],
                    "tokens": doc["tokens"],
                    "first_words": self._decode(doc["first_ids"]),
                }
                f.write(json.dumps(line, ensure_ascii=False) + "\n")
        print_log(f"TokenLossMetric: worst held-out dialogues in {path}", logger="current")


__all__ = [
    "WORST_FILE",
    "TokenLossMetric",
    "per_sample_results",
    "row_bounds",
    "row_documents",
    "row_scores",
]
