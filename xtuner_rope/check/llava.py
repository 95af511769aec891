"""``xtuner-rope check`` for XTuner's LLaVA configs, through the real ``LLaVAModel``.

Each sample of the first batches, located in the *expanded* rows (``n - 1 + P`` with an
image): (1) unpatched, alone with its image; (2) the plugin's hooks run as in training; (3)
patched, the batch as the training step calls it: logits, loss and gradients against (1), and
the expansion's row lengths against the doctor's arithmetic (``check.report`` judges).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from mmengine.config import Config

from xtuner_rope.batch.image_packing import expanded_length, llava_samples
from xtuner_rope.batch.images import IMAGE_TOKEN_INDEX
from xtuner_rope.capture import measure as cm
from xtuner_rope.capture.measure import BOUNDARY_HOOKS
from xtuner_rope.check import text
from xtuner_rope.check.report import judge, report_head
from xtuner_rope.check.runner import CheckRequest, apply_patch, first_batches, prepared_runner
from xtuner_rope.config.multimodal import is_llava
from xtuner_rope.doctor.llava_stats import image_tokens_of
from xtuner_rope.models.rope_documents import reset_upstream_rotaries
from xtuner_rope.models.runtime import chosen_backends

KIND = "llava"


def applies(cfg: Config) -> bool:
    """A config whose model is XTuner's ``LLaVAModel``."""
    return is_llava(cfg)


def _alone_batch(data: dict, sample: dict) -> dict:
    """One sample as XTuner's ``default_collate_fn`` collates it alone (its own image)."""
    r, (a, e) = sample["row"], sample["raw"]
    ids = data["input_ids"][r, a:e][None]
    return {
        "data": {
            "input_ids": ids,
            "labels": data["labels"][r, a:e][None],
            "attention_mask": torch.ones_like(ids, dtype=torch.bool),
            "pixel_values": data["pixel_values"][sample["image"]][None],
        },
        "data_samples": None,
    }


class _LLMInputs:
    """Records what the LLM is called with (the expansion's output), per forward."""

    def __init__(self, llm) -> None:
        self.calls: list[dict] = []
        self._handle = llm.register_forward_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs, output) -> None:
        self.calls.append(
            {
                k: kwargs[k].detach().cpu()
                for k in ("attention_mask", "position_ids", "labels")
                if kwargs.get(k) is not None
            }
        )

    def remove(self) -> None:
        self._handle.remove()


def _alone(
    model, data: dict, samples: list[dict], n_labels: int, backward: bool, recorder: _LLMInputs
) -> tuple[list[torch.Tensor], float, list[int]]:
    """Each sample alone through ``LLaVAModel``: logits ``[n', V]``, loss, expanded lengths."""
    logits, total, lengths = [], 0.0, []
    with torch.set_grad_enabled(backward):
        for sample in samples:
            reset_upstream_rotaries(model)  # dynamic NTK is stateful upstream: each as loaded
            batch = model.data_preprocessor(_alone_batch(data, sample), True)
            out = model(**batch, mode="tensor")
            labels = recorder.calls[-1]["labels"][0]
            loss = cm.token_loss_sum(out.logits[0], labels) / n_labels
            if backward:
                (-loss).backward()
            logits.append(out.logits[0].detach().float().cpu())
            lengths.append(out.logits.shape[1])
            total += float(loss.detach())
    return logits, total, lengths


def _prompt(data: dict, sample: dict) -> torch.Tensor:
    """``[1, k]`` text ids of a sample up to its first supervised label, image dropped."""
    r, (a, e) = sample["row"], sample["raw"]
    ids, prompt = data["input_ids"][r, a:e], cm.prompt_of(data, (r, a, e))[0]
    prompt = prompt[prompt != IMAGE_TOKEN_INDEX]
    return (prompt if len(prompt) else ids[ids != IMAGE_TOKEN_INDEX][:1])[None]


def _measure(runner, batches: list, hooks: dict, new_tokens: int, p: int) -> dict:
    model, llm = runner.model, runner.model.llm
    recorder = _LLMInputs(llm)
    try:
        refs = []
        for i, (data_batch, samples) in enumerate(batches):
            data = data_batch["data"]
            raw = [(s["row"], *s["raw"]) for s in samples]
            n_packed, n_docs = cm.label_count(data["labels"], raw)
            logits, loss, lengths = _alone(model, data, samples, n_packed, i == 0, recorder)
            refs.append(
                {
                    "logits": logits,
                    "loss": loss,
                    "labels": (n_packed, n_docs),
                    "lengths": lengths,
                    "predicted": [
                        expanded_length(data["input_ids"][s["row"], slice(*s["raw"])], p)
                        for s in samples
                    ],
                }
            )
        ref_grad = cm.grad_scale(model)
        first = batches[0]
        prompt = _prompt(first[0]["data"], first[1][0])
        generated_ref = cm.greedy(llm, prompt, new_tokens)
        patched = apply_patch(runner, hooks)
        chosen_backends(reset=True)
        results = []
        for i, ((data_batch, samples), ref) in enumerate(zip(batches, refs)):
            b = data_batch["data"]["input_ids"].shape[0]
            packed = data_batch["data"].get("cumulative_len") is not None
            recorder.calls.clear()
            logits, loss, dropped = cm.packed_forward(
                runner, data_batch, hooks, BOUNDARY_HOOKS, backward=i == 0
            )
            seen = recorder.calls[-1]
            rows = (
                seen["attention_mask"].bool().sum(dim=1).tolist()
                if "attention_mask" in seen
                else [logits.shape[1]] * b
            )
            predicted = [0] * b
            for sample in samples:
                predicted[sample["row"]] = max(predicted[sample["row"]], sample["expanded"][1])
            docs = [(sm["row"], *sm["expanded"]) for sm in samples]
            result = text.batch_result(data_batch, docs, ref, (logits, loss, dropped))
            result["expanded_tokens_per_row"] = logits.shape[1]
            result["image_samples"] = sum(sm["has_image"] for sm in samples)
            result["expansion"] = {
                "image_tokens": p,
                "rows_predicted": predicted,
                "rows_expanded": rows,
                "samples_predicted": ref["predicted"],
                "samples_alone": ref["lengths"],
            }
            result["boundaries"] = (
                "cumulative_len, expanded after the image expansion"
                if packed
                else "one sample per row (padded)"
            )
            results.append(result)
    finally:
        recorder.remove()
    out = text.outcome(
        runner, model, patched, results, ref_grad, (prompt, generated_ref, new_tokens)
    )
    trainable = [n for n, q in model.named_parameters() if q.requires_grad]
    out["grads"]["trained"] = sorted({n.split(".")[0] for n in trainable})
    return out


def _cut(data_batch: dict, samples: list[dict], max_documents: int) -> list[dict]:
    """Keep whole rows (each is its own sequence) up to ``max_documents`` samples, and the
    images those rows take (one per placeholder, one per row without any)."""
    data = data_batch["data"]
    keep, count = 0, 0
    for r in range(data["input_ids"].shape[0]):
        n = sum(s["row"] == r for s in samples)
        if keep and count + n > max_documents:
            break
        keep, count = keep + 1, count + n
    if keep == data["input_ids"].shape[0]:
        return samples
    ids = data["input_ids"]
    images = sum(max(1, int((ids[r] == IMAGE_TOKEN_INDEX).sum())) for r in range(keep))
    for key in ("input_ids", "labels", "attention_mask", "position_ids"):
        if isinstance(data.get(key), torch.Tensor) and data[key].dim() == 2:
            data[key] = data[key][:keep]
    data["pixel_values"] = data["pixel_values"][:images]
    if data.get("cumulative_len") is not None:
        data["cumulative_len"] = data["cumulative_len"][:keep]
        data["max_seqlen"] = max(int((cu[1:] - cu[:-1]).max()) for cu in data["cumulative_len"])
    return [s for s in samples if s["row"] < keep]


def expansion_problems(report: dict) -> list[str]:
    """The real expansion's lengths against the doctor's arithmetic (``n - k + k * P``)."""
    problems = []
    for i, b in enumerate(report["batches"]):
        e = b["expansion"]
        if (
            e["rows_predicted"] != e["rows_expanded"]
            or e["samples_predicted"] != e["samples_alone"]
        ):
            problems.append(
                f"batch {i}: XTuner's expansion made rows of {e['rows_expanded']} tokens "
                f"(samples alone {e['samples_alone']}), the doctor's count with "
                f"{e['image_tokens']} tokens per image gives {e['rows_predicted']} "
                f"({e['samples_predicted']}): the doctor's figures are wrong for this tower"
            )
    return problems


def run(cfg: Config, request: CheckRequest) -> dict:
    """Measure a started LLaVA config (the kind's entry in ``KINDS``); see the module docstring.

    Args: as :func:`xtuner_rope.check.text.run`.

    Returns:
        The JSON-ready report (``kind='llava'``, the text check's fields plus ``multimodal``
        and each batch's ``expansion``), with ``verdict``, ``problems`` and ``exit_code``.
    """
    p = image_tokens_of(cfg)
    prepared = prepared_runner(cfg, Path(request.work_dir), request.dtype)
    runner, hooks = prepared.runner, prepared.hooks
    cut = []
    for data_batch, _ in first_batches(cfg, request.batches):
        samples = llava_samples(data_batch["data"], p["image_tokens"])
        cut.append((data_batch, _cut(data_batch, samples, request.max_documents)))
    passes = functools.partial(_measure, p=p["image_tokens"])
    measured = text.measure(runner, cut, hooks, request.new_tokens, passes)
    model = runner.model
    name = f"LLaVAModel({type(model.visual_encoder).__name__} + {type(model.llm).__name__})"
    size = sum(q.numel() for q in model.parameters())
    report = {
        "kind": "llava",
        **report_head(cfg, request, prepared, measured, name, size),
        "multimodal": p,
        **measured,
    }
    verdict = judge(report)
    problems = verdict["problems"] = verdict["problems"] + expansion_problems(report)
    verdict["exit_code"] = int(bool(problems))
    if verdict["verdict"].startswith("PASS"):
        verdict["verdict"] = (
            "FAIL: " + problems[0]
            if problems
            else "PASS: each sample's LLM logits, loss and gradients in the batch (after the "
            "image expansion) equal the sample alone through LLaVAModel; generation unchanged"
        )
    report.update(verdict)
    return report


def summary(report: dict) -> str:
    """The text check's summary plus the image lines (``KINDS``)."""
    lines = text.summary(report).splitlines()
    b = report["batches"][0]
    e = b["expansion"]
    at = next(i for i, line in enumerate(lines) if line.startswith("  batches"))
    lines.insert(
        at + 1,
        f"  images   {b['image_samples']} of {b['documents']} samples with an "
        f"image, {e['image_tokens']} LLM tokens each; rows {b['tokens_per_row']} ids "
        f"-> {b['expanded_tokens_per_row']} tokens after XTuner's expansion (rows "
        f"{e['rows_expanded']}, doctor's count {e['rows_predicted']})",
    )
    return "\n".join(lines)
