"""The measurements of ``xtuner-rope check`` and the captures: a batch's documents, packed against
alone (fp32, CPU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from xtuner_rope.batch.checks import IGNORE_INDEX, row_boundaries
from xtuner_rope.models import channel
from xtuner_rope.models.rope_documents import reset_upstream_rotaries
from xtuner_rope.ops.packing import cumulative_from_position_ids

# The hooks that turn a packed batch's boundaries into what attention reads (the plugin's, and
# XTuner's own for use_varlen_attn): every check pass runs them before its forward.
BOUNDARY_HOOKS = ("PackedBatchCheckHook", "VarlenAttnArgsToMessageHubHook")

# Keys of XTuner batches that the HF forward does not take (the boundary hooks pop them).
BOUNDARY_KEYS = ("cumulative_len", "max_seqlen", "num_unsupervised")

Doc = tuple[int, int, int]  # (row, start, end) in the batch's [b, s] token grid


def _row_segments(data: dict, recorded: list[list[int]] | None) -> tuple[list[list[int]], str]:
    """Each row's boundaries and where they came from."""
    b, s = data["input_ids"].shape
    if data.get("cumulative_len") is not None:
        return [[int(c) for c in cu] for cu in row_boundaries(data, b)], "cumulative_len"
    if recorded is not None:
        return [
            cu if cu[-1] == s else cu + [s] for cu in recorded
        ], "XTuner's packs rebuilt with use_varlen_attn=True (not recorded in the batch)"
    position_ids = data.get("position_ids")
    if position_ids is not None:
        rows = [cumulative_from_position_ids(p).tolist() for p in position_ids.expand(b, s)]
        if any(len(r) > 2 for r in rows):
            return rows, "position_ids resets"
    mask = data.get("attention_mask")
    lengths = [int(m.sum()) for m in mask] if mask is not None else [s] * b
    return [[0, n] if n == s else [0, n, s] for n in lengths], "one document per row"


def documents(
    data: dict, recorded: list[list[int]] | None, max_documents: int
) -> tuple[list[tuple[int, int, int]], str]:
    """``[(row, start, end)]`` of the batch's documents (segments with a supervised label after
    their first token), and where the boundaries came from.

    The rows of ``data`` are cut in place after the first ``max_documents`` documents: causal
    attention makes the cut batch an exact, smaller instance of it. ``recorded``: each row's
    boundaries when the batch does not carry them.

    Raises:
        ValueError: the batch has no supervised label.
    """
    rows, source = _row_segments(data, recorded)
    labels = data["labels"]
    spans = [
        (r, a, e)
        for r, cu in enumerate(rows)
        for a, e in zip(cu[:-1], cu[1:])
        if bool((labels[r, a + 1 : e] != IGNORE_INDEX).any())
    ]
    if not spans:
        raise ValueError(
            "xtuner-rope check: the first batch has no supervised label: nothing "
            "to compare. Check the dataset's label masking (xtuner-rope doctor)."
        )
    cut = max(e for _, _, e in spans[:max_documents])
    if cut < data["input_ids"].shape[1]:
        _cut_rows(data, rows, cut)
    return [(r, a, min(e, cut)) for r, a, e in spans if a < cut], source


def _cut_rows(data: dict, rows: list[list[int]], cut: int) -> None:
    """Keep columns ``[:cut]`` of every ``[b, s]`` field; boundaries cut to match."""
    for key in ("input_ids", "labels", "position_ids", "attention_mask"):
        if isinstance(data.get(key), torch.Tensor) and data[key].dim() == 2:
            data[key] = data[key][:, :cut]
    if data.get("cumulative_len") is not None:
        cus = [torch.tensor([c for c in cu if c < cut] + [cut], dtype=torch.int32) for cu in rows]
        data["cumulative_len"] = cus
        if "max_seqlen" in data:
            data["max_seqlen"] = max(int((cu[1:] - cu[:-1]).max()) for cu in cus)


def label_count(labels: torch.Tensor, docs: list[Doc]) -> tuple[int, int]:
    """``(packed, documents)``: the supervised labels the packed loss averages over (``[b, s]``
    ``labels``) and those ``docs`` hold (fewer when a document's first token has a label)."""
    packed = int((labels[:, 1:] != IGNORE_INDEX).sum())
    alone = sum(int((labels[r, a + 1 : e] != IGNORE_INDEX).sum()) for r, a, e in docs)
    return packed, alone


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropies of one sequence (``logits [n, V]``, ``labels [n]``)."""
    return F.cross_entropy(
        logits[:-1].float(),
        labels[1:].to(logits.device),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def documents_alone(
    llm, data: dict, docs: list[Doc], n_labels: int, backward: bool
) -> tuple[list[torch.Tensor], float]:
    """Each document through ``llm`` alone (positions from 0, no other token), fp32 on the CPU.

    Args:
        data: The packed batch (``input_ids``, ``labels`` ``[b, s]``, on the CPU).
        n_labels: Divisor of the loss (the packed loss's label count).
        backward: Backpropagate ``-(sum of the documents' token losses) / n_labels``
            (``.grad`` then holds minus the reference gradient of the packed loss).

    Returns the ``[len, V]`` logits of each document and the reference loss.
    """
    device = next(llm.parameters()).device
    logits, total = [], 0.0
    with torch.set_grad_enabled(backward):
        for r, a, e in docs:
            reset_upstream_rotaries(llm)  # dynamic NTK is stateful upstream: each doc as loaded
            ids = data["input_ids"][r, a:e].to(device)[None]  # [1, len]
            positions = torch.arange(e - a, device=device)[None]  # [1, len]
            out = llm(input_ids=ids, position_ids=positions, use_cache=False).logits[0]
            loss = token_loss_sum(out, data["labels"][r, a:e]) / n_labels
            if backward:
                (-loss).backward()
            logits.append(out.detach().float().cpu())
            total += float(loss.detach())
    return logits, total


def packed_forward(
    runner, data_batch: dict, hooks: dict, boundary_hooks: tuple[str, ...], backward: bool
) -> tuple[torch.Tensor, float, list[str]]:
    """The packed batch through the model as MMEngine's training step runs it (the boundary hooks'
    ``before_train_iter``, ``data_preprocessor``, ``forward(mode='tensor')``).

    Returns:
        ``[b, s, V]`` fp32 logits (CPU), the loss, and the boundary keys no hook consumed
        (dropped).
    """
    for name in boundary_hooks:
        if name in hooks:
            hooks[name].before_train_iter(runner, batch_idx=0, data_batch=data_batch)
    data = data_batch["data"]
    dropped = [k for k in BOUNDARY_KEYS if k in data]
    for key in dropped:
        data.pop(key)
    try:
        with torch.set_grad_enabled(backward):
            batch = runner.model.data_preprocessor(data_batch, True)
            out = runner.model(**batch, mode="tensor")
            if backward:
                out.loss.backward()
    finally:
        channel.clear()  # the boundaries the hooks published, as their after_train_iter does
    return out.logits.detach().float().cpu(), float(out.loss.detach()), dropped


def logits_differences(
    packed: torch.Tensor, alone: list[torch.Tensor], docs: list[Doc]
) -> list[dict]:
    """Per document: max ``|packed - alone|`` of its logits, and the largest logit alone."""
    return [
        {
            "row": r,
            "start": a,
            "tokens": e - a,
            "max_abs_diff": float((packed[r, a:e] - ref).abs().max()),
            "max_abs_logit": float(ref.abs().max()),
        }
        for (r, a, e), ref in zip(docs, alone)
    ]


def grad_scale(model) -> float:
    """Largest ``|grad|`` over the trainable parameters (0.0 when none has a gradient)."""
    values = [
        p.grad.detach().abs().max()
        for p in model.parameters()
        if p.requires_grad and p.grad is not None
    ]
    return float(torch.stack(values).max().float()) if values else 0.0


def prompt_of(data: dict, doc: Doc) -> torch.Tensor:
    """``[1, k]`` ids of a document up to its first supervised label (its prompt)."""
    r, a, e = doc
    supervised = (data["labels"][r, a:e] != IGNORE_INDEX).nonzero().flatten()
    k = max(int(supervised[0]) if len(supervised) else e - a, 1)
    return data["input_ids"][r, a : a + k][None]


@torch.no_grad()
def greedy(llm, prompt: torch.Tensor, new_tokens: int) -> list[int]:
    """``new_tokens`` greedy tokens after ``prompt`` (eval mode; the KV cache as upstream)."""
    was_training = llm.training
    llm.eval()
    reset_upstream_rotaries(llm)  # as loaded (unpatched dynamic NTK keeps grown frequencies)
    try:
        ids = prompt.to(next(llm.parameters()).device)
        out = llm.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=0,
        )
    finally:
        llm.train(was_training)
    return out[0, ids.shape[1] :].tolist()
