"""The promise of whole-dialogue packing, as a gradient: packing changes the speed, never the numbers.

One epoch's summed token-weighted gradient (sum of every supervised token's loss / supervised
tokens) of the rows ``pack_dataset`` builds, through the patched tiny InternLM2, equals the
gradient of the same dialogues run one by one, unpadded, through the unpatched model (fp32).
XTuner's cut of the same stream (``offline_packing = "cut"``) trains other numbers: a cut
dialogue's second piece starts at position 0 mid-answer, and its first target is lost.
"""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset

from xtuner_rope.data.packed_dataset import pack_dataset
from xtuner_rope.demo.tiny import build_tiny_internlm2
from xtuner_rope.models.dispatch import patch_model

VOCAB, MAX_LENGTH = 256, 64


def _dialogues(n: int, seed: int) -> Dataset:
    """Prompt (labels -100) then answer (labels = ids), 4..48 tokens, as XTuner tokenizes."""
    rng = np.random.default_rng(seed)
    rows = []
    for length in rng.integers(4, 49, n):
        ids = rng.integers(3, VOCAB, length)
        labels = np.where(np.arange(length) < rng.integers(1, length), -100, ids)
        rows.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    return Dataset.from_list(rows)


def _row_loss(model, ids: list, labels: list, bounds: list) -> tuple[torch.Tensor, int]:
    """Summed next-token loss of one row and its supervised tokens; each document's first
    label is ignored (the shift would predict it from the previous document's last token)."""
    ids_t = torch.tensor(ids)[None]  # [1, s]
    pos = torch.cat([torch.arange(b - a) for a, b in zip(bounds[:-1], bounds[1:])])[None]
    target = torch.tensor(labels)
    target[torch.tensor(bounds[:-1])] = -100
    logits = model(input_ids=ids_t, position_ids=pos).logits[0]  # [s, vocab]
    loss = F.cross_entropy(logits[:-1], target[1:], ignore_index=-100, reduction="sum")
    return loss, int((target[1:] != -100).sum())


def _epoch_gradient(model, rows) -> dict[str, torch.Tensor]:
    """Token-weighted gradient of one epoch over ``rows`` of ``(ids, labels, bounds)``."""
    model.zero_grad()
    total, count = 0.0, 0
    for ids, labels, bounds in rows:
        loss, n = _row_loss(model, ids, labels, bounds)
        total, count = total + loss, count + n
    (total / count).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def _packed_rows(packed: Dataset):
    return zip(packed["input_ids"], packed["labels"], packed["cumulative_len"])


def _max_error(got: dict, want: dict) -> float:
    """Largest gradient error, relative to each parameter's largest gradient entry."""
    return max(
        float((got[k] - want[k]).abs().max() / want[k].abs().max().clamp(min=1e-8)) for k in want
    )


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    reference = build_tiny_internlm2(VOCAB, attn_implementation="sdpa").float().train()
    patched = copy.deepcopy(reference)
    patch_model(patched)
    return reference, patched


def test_whole_dialogue_packing_trains_the_gradient_of_unpacked_training(models):
    reference, patched = models
    dialogues = _dialogues(60, 0)
    unpacked = [(ids, labels, [0, len(ids)]) for ids, labels in zip(*dialogues[:].values())]
    want = _epoch_gradient(reference, unpacked)
    packed = pack_dataset(dialogues, MAX_LENGTH, True, False, 1)
    assert len(packed) < len(dialogues) / 2  # several dialogues per row
    whole_error = _max_error(_epoch_gradient(patched, _packed_rows(packed)), want)
    # XTuner's cut of the same dialogues: other fragments, another gradient.
    cut = pack_dataset(dialogues, MAX_LENGTH, True, False, 1, whole=False)
    cut_error = _max_error(_epoch_gradient(patched, _packed_rows(cut)), want)
    print(f"gradient error, relative: whole {whole_error:.2e}, XTuner's cut {cut_error:.2e}")
    assert whole_error < 1e-4  # fp32: summation order only
    assert cut_error > 1e-2
