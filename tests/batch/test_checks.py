"""Tests for xtuner_rope.batch.checks: accepts what the collate functions build, names every fault."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from xtuner.dataset import collate_fns

from xtuner_rope.batch.checks import check_packed_batch
from xtuner_rope.data.collate import rope_collate_fn

PROPERTY = settings(deadline=None)  # example counts: the hypothesis profiles in conftest.py


def _batch(**options):
    """Two rows: [3-token doc, 2-token doc, 1 pad] and [4-token doc, 2 pads]; s = 6."""
    items = [
        {
            "input_ids": [1, 2, 3, 4, 5],
            "labels": [-100, 2, 3, -100, 5],
            "cumulative_len": [0, 3, 5],
        },
        {"input_ids": [6, 7, 8, 9], "labels": [-100, 7, 8, 9]},
    ]
    return rope_collate_fn(items, min_length=6, return_hf_format=True, **options)


def _bad(data, field, value):
    data = dict(data)
    data[field] = value
    return data


@PROPERTY
@given(
    st.lists(st.lists(st.integers(2, 9), min_size=1, max_size=3), min_size=1, max_size=5),
    st.booleans(),
    st.integers(0, 9),
)
def test_accepts_every_rope_collate_output(docs_per_item, pack, extra):
    items, first = [], 1
    for lengths in docs_per_item:
        n = sum(lengths)
        ids = list(range(first, first + n))
        cu = [0]
        for length in lengths:
            cu.append(cu[-1] + length)
        items.append({"input_ids": ids, "labels": ids, "cumulative_len": cu})
        first += n
    longest = max(map(sum, docs_per_item))
    data = rope_collate_fn(
        items, pack=pack, max_length=longest + extra, min_length=extra, return_hf_format=True
    )
    check_packed_batch(data, vocab_size=first, max_position=data["input_ids"].shape[1])
    # XTuner's layout for batch size 1: a bare tensor instead of a list.
    check_packed_batch(
        _bad(data, "cumulative_len", data["cumulative_len"][0])
        if len(data["cumulative_len"]) == 1
        else data
    )


def test_accepts_batches_without_boundaries():
    data = _batch()
    # Boundaries read from position ids.
    check_packed_batch(_bad(data, "cumulative_len", None))
    # A plain HF batch: one segment per row, positions 0..s-1 implied.
    check_packed_batch({"input_ids": data["input_ids"], "labels": data["labels"]})


def test_accepts_xtuner_default_collate_output():
    items = [{"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}, {"input_ids": [4], "labels": [4]}]
    check_packed_batch(collate_fns.default_collate_fn(items, return_hf_format=True))


@pytest.mark.parametrize(
    "mutate, match",
    [
        (
            lambda d: {"labels": d["labels"]},
            r"field 'input_ids': expected a batch dict with input_ids "
            r"and labels, got keys \['labels'\]\. Pass the inner data dict",
        ),
        (
            lambda d: _bad(d, "input_ids", torch.ones(0, 3, dtype=torch.long)),
            r"field 'input_ids': expected a non-empty \[b, s\] tensor, got shape \[0, 3\]",
        ),
        (
            lambda d: _bad(d, "input_ids", d["input_ids"][0]),
            r"field 'input_ids': expected a non-empty \[b, s\] tensor, got shape \[6\]",
        ),
        (
            lambda d: _bad(d, "labels", d["labels"][:, :5]),
            r"field 'labels': expected shape \[2, 6\] like input_ids, got \[2, 5\]",
        ),
        (
            lambda d: _bad(d, "position_ids", d["position_ids"][:1]),
            r"field 'position_ids': expected shape \[2, 6\] like input_ids, got \[1, 6\]",
        ),
        (
            lambda d: _bad(d, "attention_mask", torch.ones(2, 7, dtype=torch.bool)),
            r"field 'attention_mask': expected shape \[2, 6\]",
        ),
        (
            lambda d: _bad(d, "cumulative_len", d["cumulative_len"][:1]),
            r"field 'cumulative_len': expected one boundary tensor per row \(2\), got 1",
        ),
        (
            lambda d: _bad(d, "cumulative_len", [d["cumulative_len"][0], torch.tensor([0])]),
            r"row 1, field 'cumulative_len': expected at least 2 boundaries \[0, \.\.\., s\], got \[0\]",
        ),
        (
            lambda d: _bad(d, "cumulative_len", [d["cumulative_len"][0], torch.tensor([1, 6])]),
            r"row 1, field 'cumulative_len': expected boundaries that start at 0, got \[1, 6\]",
        ),
        (
            lambda d: _bad(d, "cumulative_len", [torch.tensor([0, 3, 5]), d["cumulative_len"][1]]),
            r"row 0, field 'cumulative_len': expected boundaries that end at s=6, got \[0, 3, 5\]",
        ),
        (
            lambda d: _bad(
                d, "cumulative_len", [torch.tensor([0, 3, 3, 6]), d["cumulative_len"][1]]
            ),
            r"row 0, document 1, field 'cumulative_len': expected strictly increasing boundaries "
            r"\(no empty document\), got cumulative_len\[1:3\] = \[3, 3\]",
        ),
        (
            lambda d: _bad(
                d, "cumulative_len", [torch.tensor([0, 2, 5, 6]), d["cumulative_len"][1]]
            ),
            r"row 0, document 1, field 'position_ids': expected 0 at column 2 \(0 at each document "
            r"start, \+1 within\), got 2",
        ),
        (
            lambda d: _bad(
                _bad(d, "cumulative_len", None),
                "position_ids",
                torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 2]]),
            ),
            r"row 1, document 1, field 'position_ids': expected 1 at column 5 .* got 2",
        ),
        (
            lambda d: _bad(d, "max_seqlen", 3),
            r"field 'max_seqlen': expected the longest segment, 4, got 3",
        ),
        (
            lambda d: _bad(d, "labels", d["labels"].masked_fill(d["labels"] == 8, -1)),
            r"row 1, document 0, field 'labels': expected ids >= 0 or -100 \(column 2\), got -1",
        ),
        (
            lambda d: _bad(d, "input_ids", d["input_ids"].masked_fill(d["input_ids"] == 8, -5)),
            r"row 1, document 0, field 'input_ids': expected ids >= 0 \(column 2\), got -5",
        ),
        (
            lambda d: _bad(d, "attention_mask", torch.tensor([[True] * 6, [False] * 6])),
            r"row 1, field 'attention_mask': expected at least one attended token per row, got none",
        ),
        (
            lambda d: _bad(d, "labels", torch.full_like(d["labels"], -100)),
            r"field 'labels': expected at least one supervised label \(!= -100\) after column 0, got "
            r"none in rows \[0, 1\] \(the mean loss would be 0/0 = NaN\)\. .*filter samples",
        ),
    ],
)
def test_value_errors(mutate, match):
    with pytest.raises(ValueError, match=match):
        check_packed_batch(mutate(_batch()))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            {"vocab_size": 9},
            r"row 1, document 0, field 'input_ids': expected ids in \[0, 9\) "
            r"\(column 3\), got 9\. Check the tokenizer",
        ),
        (
            {"max_position": 3},
            r"row 1, document 0, field 'position_ids': expected positions < "
            r"max_position=3 \(the RoPE range\), got 3\. Lower max_length",
        ),
    ],
)
def test_value_errors_with_limits(kwargs, match):
    with pytest.raises(ValueError, match=match):
        check_packed_batch(_batch(), **kwargs)


def test_label_outside_vocab():
    data = _batch()
    data["labels"][0, 4] = 50
    with pytest.raises(
        ValueError,
        match=r"row 0, document 1, field 'labels': expected ids in "
        r"\[0, 10\) or -100 \(column 4\), got 50",
    ):
        check_packed_batch(data, vocab_size=10)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (
            lambda d: _bad(d, "input_ids", d["input_ids"].float()),
            r"field 'input_ids': expected a tensor of dtype torch.int64, got torch.float32",
        ),
        (
            lambda d: _bad(d, "labels", d["labels"].int()),
            r"field 'labels': expected a tensor of dtype torch.int64, got torch.int32",
        ),
        (
            lambda d: _bad(d, "position_ids", d["position_ids"].tolist()),
            r"field 'position_ids': expected a tensor of dtype torch.int64, got list",
        ),
        (
            lambda d: _bad(d, "attention_mask", torch.ones(2, 6)),
            r"field 'attention_mask': expected a tensor of dtype torch.bool or torch.int64 or "
            r"torch.int32, got torch.float32",
        ),
        (
            lambda d: _bad(d, "cumulative_len", [c.float() for c in d["cumulative_len"]]),
            r"row 0, field 'cumulative_len': expected integer values, got dtype torch.float32\. Use "
            r"an integer tensor \(int32 for flash-attn\)",
        ),
    ],
)
def test_type_errors(mutate, match):
    data = _batch()
    data["attention_mask"] = torch.ones(2, 6, dtype=torch.bool)
    with pytest.raises(TypeError, match=match):
        check_packed_batch(mutate(data))
