"""Tests for xtuner_rope.data.collate: properties, live XTuner references, every error message."""

import warnings
from itertools import accumulate

import datasets
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from xtuner import utils as xtuner_utils
from xtuner.dataset import collate_fns
from xtuner.dataset.utils import Packer

from xtuner_rope.batch.checks import check_packed_batch
from xtuner_rope.data.collate import DEFAULT_PAD_TOKEN_INDEX, IGNORE_INDEX, rope_collate_fn
from xtuner_rope.ops.packing import padded_length

PROPERTY = settings(deadline=None)  # example counts: the hypothesis profiles in conftest.py


def make_item(docs, first_id=1, mode="plain", as_tensor=False):
    """Build an XTuner-style item from documents given as per-token "supervised" flags.

    Token ids are ``first_id, first_id + 1, ...`` so tests can find every token again.
    ``mode``: 'plain' (one document, no boundaries), 'cu', 'pos' or 'both' (what an
    XTuner-packed item carries).
    """
    flags = [f for doc in docs for f in doc]
    ids = list(range(first_id, first_id + len(flags)))
    item = {"input_ids": ids, "labels": [t if f else IGNORE_INDEX for t, f in zip(ids, flags)]}
    if mode in ("cu", "both"):
        item["cumulative_len"] = [0, *accumulate(len(d) for d in docs)]
    if mode in ("pos", "both"):
        item["position_ids"] = [p for d in docs for p in range(len(d))]
    if as_tensor:
        item = {k: torch.tensor(v) for k, v in item.items()}
    return item


def is_supervised(docs):
    """A label counts only after a document's first token (the shift never uses that one)."""
    return any(any(doc[1:]) for doc in docs)


@st.composite
def batches(draw):
    packed_items = draw(st.booleans())
    mode = draw(st.sampled_from(["cu", "pos", "both"])) if packed_items else "plain"
    n_docs = st.integers(1, 4) if packed_items else st.just(1)
    doc = st.lists(st.booleans(), min_size=1, max_size=10)
    items_docs = draw(
        st.lists(
            n_docs.flatmap(lambda k: st.lists(doc, min_size=k, max_size=k)), min_size=1, max_size=6
        )
    )
    longest = max(sum(map(len, docs)) for docs in items_docs)
    pack = draw(st.booleans())
    max_length = (
        longest + draw(st.integers(0, 12))
        if pack
        else draw(st.one_of(st.none(), st.integers(longest, longest + 5)))
    )
    options = dict(
        pack=pack,
        max_length=max_length,
        pad_to_multiple_of=draw(st.one_of(st.none(), st.integers(1, 8))),
        min_length=draw(st.one_of(st.none(), st.integers(0, 40))),
    )
    return items_docs, mode, draw(st.booleans()), options


def token_wise_loss(data, embed, head):
    """Summed shifted CE of a model whose logits depend on each token alone."""
    logits = head(embed(data["input_ids"]))
    return F.cross_entropy(
        logits[:, :-1].flatten(0, 1),
        data["labels"][:, 1:].flatten(),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def assert_invariants(data, kept, options, carried):
    """``kept``: (item, docs) pairs that must appear in the batch, in input order."""
    pack, max_length = options["pack"], options["max_length"]
    ids, labels, pos = data["input_ids"], data["labels"], data["position_ids"]
    b, s = ids.shape
    assert labels.shape == pos.shape == (b, s) and ids.dtype == labels.dtype == torch.long
    real = ids != DEFAULT_PAD_TOKEN_INDEX  # item ids are >= 1
    real_len = real.sum(1)
    assert bool((real_len >= 1).all())  # every row attends to something
    assert bool(real.long().diff(dim=1).le(0).all())  # real tokens first, then padding
    assert s == padded_length(
        int(real_len.max()),
        pad_to_multiple_of=options["pad_to_multiple_of"],
        min_length=options["min_length"],
    )
    assert bool((labels[~real] == IGNORE_INDEX).all())
    real_steps, pad_steps = [], []
    for r, cu in enumerate(data["cumulative_len"]):
        assert cu.dtype == torch.int32 and cu[0] == 0 and cu[-1] == s
        steps = cu.diff()
        assert bool((steps > 0).all())
        n = int(real_len[r])
        assert n in cu.tolist()
        k = cu.tolist().index(n)
        real_steps += steps[:k].tolist()
        pad_steps.append(steps[k:].tolist())
        want = torch.cat([torch.arange(int(k)) for k in steps])
        assert torch.equal(pos[r], want)
        assert bool((labels[r, cu[1:-1].long()] == IGNORE_INDEX).all())
    # Padding: segments one shorter than the longest document (1 if that is 1), the last one
    # shorter or equal; so the largest position, which an error about the RoPE range names,
    # is a real document's, never padding's.
    longest = max(real_steps)
    cap = max(longest - 1, 1)
    assert all(p[:-1] == [cap] * (len(p) - 1) and p[-1:] <= [cap] for p in pad_steps)
    assert data["max_seqlen"] == longest
    assert bool(real[pos == longest - 1].all())
    assert int(real.sum()) == sum(len(item["input_ids"]) for item, _ in kept)
    for k, (item, docs) in enumerate(kept):
        item_ids = torch.as_tensor(item["input_ids"])
        r, c = (int(v) for v in (ids == item_ids[0]).nonzero()[0])
        n = item_ids.numel()
        assert torch.equal(ids[r, c : c + n], item_ids)  # contiguous, order preserved
        want = torch.as_tensor(item["labels"]).clone()
        starts = [c + o for o in accumulate([0] + [len(d) for d in docs[:-1]])]
        want[[o - c for o in starts if o > 0]] = IGNORE_INDEX
        assert torch.equal(labels[r, c : c + n], want)
        assert set(starts) <= set(data["cumulative_len"][r].tolist())
        if not pack:
            assert (r, c) == (k, 0)
    if pack:
        assert bool((real_len <= max_length).all()) and b <= len(kept)
    assert ("attention_mask" in data) == (not pack and not carried)
    if "attention_mask" in data:
        assert torch.equal(data["attention_mask"], real)


@PROPERTY
@given(batches(), st.booleans())
def test_collate_properties(case, drop):
    items_docs, mode, as_tensor, options = case
    items, first = [], 1
    for docs in items_docs:
        items.append(make_item(docs, first, mode, as_tensor))
        first += sum(map(len, docs))
    supervised = [is_supervised(docs) for docs in items_docs]
    kept = [(item, docs) for item, docs, ok in zip(items, items_docs, supervised) if ok or not drop]
    if not any(supervised):  # the mean loss would be 0/0: refused with or without dropping
        with pytest.raises(ValueError, match=r"all \d+ samples of the batch have no supervised"):
            rope_collate_fn(items, drop_unsupervised=drop, **options)
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batch = rope_collate_fn(items, drop_unsupervised=drop, **options)
    dropped = len(items) - len(kept)
    assert len(caught) == (1 if dropped else 0)
    if dropped:
        assert f"dropped {dropped} of {len(items)} samples" in str(caught[0].message)
    assert batch["data_samples"] is None
    data = batch["data"]
    assert data.pop("num_unsupervised") == (0 if drop else supervised.count(False))
    assert_invariants(data, kept, options, carried=mode != "plain")
    # Padding never leaves the range the documents need, whatever s is.
    check_packed_batch(data, vocab_size=first, max_position=data["max_seqlen"])
    # A packed row's loss is the sum of its documents' losses alone.
    embed, head = torch.nn.Embedding(first, 4), torch.nn.Linear(4, first)
    alone = sum(
        token_wise_loss(
            rope_collate_fn([make_item([d], int(item["input_ids"][o]))], return_hf_format=True),
            embed,
            head,
        )
        for item, docs in kept
        for d, o in zip(docs, accumulate([0] + [len(d) for d in docs[:-1]]))
        if any(d[1:])
    )
    torch.testing.assert_close(token_wise_loss(data, embed, head), alone)


@PROPERTY
@given(st.lists(st.integers(2, 6), min_size=1, max_size=5), st.data())
def test_empty_sample_or_document_is_named(lengths, draw):
    items = [make_item([[True] * n]) for n in lengths]
    k = draw.draw(st.integers(0, len(items)), label="sample")
    if draw.draw(st.booleans(), label="empty document"):
        docs = [[True] * n for n in draw.draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))]
        d = draw.draw(st.integers(0, len(docs)), label="document")
        item = make_item(docs, mode="cu")
        cu = item["cumulative_len"]
        item["cumulative_len"] = cu[: d + 1] + cu[d:]  # document d now has no tokens
        match = rf"sample {k}, document {d}, field .cumulative_len.: expected strictly increasing"
    else:
        item = {"input_ids": [], "labels": []}
        match = rf"sample {k}, field .input_ids.: expected at least 1 token, got 0 tokens"
    items.insert(k, item)
    with pytest.raises(ValueError, match=match):
        rope_collate_fn(items, pack=draw.draw(st.booleans()), max_length=64)


def test_one_token_final_document_keeps_its_boundary():
    item = make_item([[False, True, True], [True]], mode="cu")
    data = rope_collate_fn([item], return_hf_format=True)
    assert data["cumulative_len"][0].tolist() == [0, 3, 4]
    assert data["position_ids"].tolist() == [[0, 1, 2, 0]]
    assert data["labels"].tolist() == [[-100, 2, 3, -100]]
    assert "attention_mask" not in data


def test_pack_places_items_first_fit_decreasing_and_pads():
    items = [
        make_item([[False] + [True] * (n - 1)], first)
        for n, first in [(3, 1), (6, 10), (4, 20), (2, 30)]
    ]
    data = rope_collate_fn(
        items, 7, pack=True, max_length=8, pad_to_multiple_of=4, return_hf_format=True
    )
    # 6 opens row 0 (room 2) and takes the 2; 4 opens row 1 and takes the 3.
    assert data["input_ids"].tolist() == [
        [10, 11, 12, 13, 14, 15, 30, 31],
        [1, 2, 3, 20, 21, 22, 23, 7],
    ]
    assert [cu.tolist() for cu in data["cumulative_len"]] == [[0, 6, 8], [0, 3, 7, 8]]
    assert data["labels"][1].tolist() == [-100, 2, 3, -100, 21, 22, 23, -100]
    assert data["max_seqlen"] == 6


def test_varlen_flag_with_batch_size_above_one_and_min_length():
    items = [make_item([[False, True]]), make_item([[False, True, True]], 5)]
    data = rope_collate_fn(items, use_varlen_attn=True, min_length=6, return_hf_format=True)
    assert data["input_ids"].shape == (2, 6)
    # Row 0's 4 padding tokens: two segments, both shorter than the longest document (3).
    assert [cu.tolist() for cu in data["cumulative_len"]] == [[0, 2, 4, 6], [0, 3, 5, 6]]
    assert data["attention_mask"].sum(1).tolist() == [2, 3]


def test_inputs_are_not_modified():
    item = make_item([[True, True], [True, True]], mode="both", as_tensor=True)
    before = {k: v.clone() for k, v in item.items()}
    rope_collate_fn([item], pack=True, max_length=4)
    assert all(torch.equal(item[k], before[k]) for k in item)


# ----- live references: XTuner's own collate function and Packer -----


def test_constants_match_xtuner():
    assert IGNORE_INDEX == xtuner_utils.IGNORE_INDEX
    assert DEFAULT_PAD_TOKEN_INDEX == xtuner_utils.DEFAULT_PAD_TOKEN_INDEX


@pytest.mark.parametrize("lengths", [[5], [3, 7, 2, 4], [9, 9]])
def test_unpacked_matches_xtuner_default_collate(lengths):
    items, first = [], 1
    for n in lengths:
        items.append(make_item([[False] + [True] * (n - 1)], first))
        first += n
    ref = collate_fns.default_collate_fn(items, return_hf_format=True)
    ours = rope_collate_fn(items, return_hf_format=True)
    for key in ("input_ids", "labels", "attention_mask"):
        torch.testing.assert_close(ours[key], ref[key], rtol=0, atol=0)
    mask = ref["attention_mask"]
    # XTuner counts positions on through the padding; ours restart it as its own segment.
    torch.testing.assert_close(ours["position_ids"][mask], ref["position_ids"][mask])
    wrapped = rope_collate_fn(items)
    assert set(wrapped) == {"data", "data_samples"} and wrapped["data_samples"] is None


def _packer_items(use_varlen_attn, chunk_size=16):
    """Items from XTuner's real Packer, mapped over a datasets.Dataset as process_hf_dataset."""
    rows, first = {"input_ids": [], "labels": []}, 1
    for n in [5, 9, 3, 12, 7, 1, 6, 11, 4, 2, 8, 30, 3]:
        item = make_item([[False] + [True] * (n - 1)], first)
        rows["input_ids"].append(item["input_ids"])
        rows["labels"].append(item["labels"])
        first += n
    dataset = datasets.Dataset.from_dict(rows).map(
        Packer(chunk_size, use_varlen_attn=use_varlen_attn), batched=True, batch_size=4
    )
    return [dataset[i] for i in range(len(dataset))]


def test_xtuner_packer_items_match_xtuner_varlen_collate():
    items = _packer_items(use_varlen_attn=True)
    assert len(items) > 3 and any(len(item["cumulative_len"]) > 2 for item in items)
    for item in items:  # XTuner's varlen collate takes one item per batch
        ref = collate_fns.default_collate_fn([item], use_varlen_attn=True, return_hf_format=True)
        ours = rope_collate_fn([item], use_varlen_attn=True, return_hf_format=True)
        for key in ("input_ids", "position_ids"):
            torch.testing.assert_close(ours[key], ref[key], rtol=0, atol=0)
        torch.testing.assert_close(ours["cumulative_len"][0], ref["cumulative_len"][0])
        assert ours["max_seqlen"] == ref["max_seqlen"]
        want = ref["labels"].clone()
        want[0, ref["cumulative_len"][0][1:-1].long()] = IGNORE_INDEX
        torch.testing.assert_close(ours["labels"], want, rtol=0, atol=0)
        check_packed_batch(ours)
    # Unlike XTuner, several packed items make one batch (the short last chunk is padded).
    data = rope_collate_fn(items, use_varlen_attn=True, return_hf_format=True)
    check_packed_batch(data)
    for r, item in enumerate(items):
        n = len(item["input_ids"])
        assert data["input_ids"][r, :n].tolist() == item["input_ids"]
        assert data["position_ids"][r, :n].tolist() == item["position_ids"]
        assert (
            data["cumulative_len"][r].tolist()[: len(item["cumulative_len"])]
            == item["cumulative_len"]
        )


def test_xtuner_packer_items_without_boundaries_match_default_collate():
    items = _packer_items(use_varlen_attn=False)
    ref = collate_fns.default_collate_fn(items, return_hf_format=True)
    ours = rope_collate_fn(items, return_hf_format=True)
    # Without boundaries each chunk is one document, exactly as XTuner sees it.
    for key in ("input_ids", "labels", "attention_mask"):
        torch.testing.assert_close(ours[key], ref[key], rtol=0, atol=0)
    check_packed_batch(ours)
    check_packed_batch(ref)


# ----- every error message -----


def _item(n=3, **extra):
    return {"input_ids": list(range(1, n + 1)), "labels": list(range(1, n + 1)), **extra}


@pytest.mark.parametrize(
    "instances, kwargs, match",
    [
        ([], {}, r"got an empty batch \(0 samples\)"),
        ([_item()], {"pack": True}, r"option max_length: expected an int when pack=True, got None"),
        (
            [_item()],
            {"pad_to_multiple_of": 0},
            r"option pad_to_multiple_of: expected None or an int >= 1",
        ),
        ([_item()], {"min_length": -1}, r"option min_length: expected None or an int >= 0, got -1"),
        (
            [_item(), {"input_ids": [1, 2]}],
            {},
            r"sample 1, field 'labels': expected a dict with "
            r"'input_ids' and 'labels'.*got keys \['input_ids'\]",
        ),
        (
            [_item(), {"input_ids": [[1, 2]], "labels": [[1, 2]]}],
            {},
            r"sample 1, field 'input_ids': expected a flat sequence of ints, got shape \[1, 2\]",
        ),
        (
            [_item(), _item(0)],
            {},
            r"sample 1, field 'input_ids': expected at least 1 token, got 0 "
            r"tokens \(an empty sample\)\. Filter",
        ),
        (
            [{"input_ids": [1, 2, 3], "labels": [1, 2]}],
            {},
            r"sample 0, field 'labels': expected len\(labels\) == len\(input_ids\) == 3, got 2",
        ),
        (
            [_item(cumulative_len=[1, 3])],
            {},
            r"sample 0, field 'cumulative_len': expected a list "
            r"starting at 0 with at least 2 entries, got \[1, 3\]",
        ),
        (
            [_item(cumulative_len=[0])],
            {},
            r"sample 0, field 'cumulative_len': expected a list "
            r"starting at 0",
        ),
        (
            [_item(4, cumulative_len=[0, 2, 2, 4])],
            {},
            r"sample 0, document 1, field 'cumulative_len': expected strictly increasing boundaries "
            r"\(document 1 empty or reversed\), got cumulative_len\[1:3\] = \[2, 2\]",
        ),
        (
            [_item(4, cumulative_len=[0, 2, 5])],
            {},
            r"sample 0, field 'cumulative_len': expected last boundary == len\(input_ids\) == 4, got 5",
        ),
        (
            [_item(3, position_ids=[0, 1])],
            {},
            r"sample 0, field 'position_ids': expected len\(input_ids\) == 3 entries, got 2",
        ),
        (
            [_item(4, cumulative_len=[0, 2, 4], position_ids=[0, 1, 2, 3])],
            {},
            r"sample 0, document 1, field 'position_ids': expected 0 at column 2 \(0 at each document "
            r"start, \+1 within\), got 2",
        ),
        (
            [_item(4, position_ids=[0, 1, 3, 4])],
            {},
            r"sample 0, document 0, field 'position_ids': expected 2 at column 2",
        ),
        (
            [_item(3), _item(5)],
            {"pack": True, "max_length": 4},
            r"sample 1, field 'input_ids': expected at most max_length=4 tokens, got 5\. Truncate",
        ),
        (
            [_item(5)],
            {"max_length": 4},
            r"sample 0, field 'input_ids': expected at most max_length=4",
        ),
        (
            [{"input_ids": [1, 2], "labels": [1, -100]}, {"input_ids": [3], "labels": [3]}],
            {},
            r"all 2 samples of the batch have no supervised label \(indices \[0, 1\]\): the mean "
            r"loss would be 0/0 = NaN",
        ),
        (
            [{"input_ids": [1], "labels": [1]}],
            {"drop_unsupervised": True},
            r"all 1 samples of the batch have no supervised label \(indices \[0\]\)",
        ),
    ],
)
def test_value_errors(instances, kwargs, match):
    with pytest.raises(ValueError, match=match):
        rope_collate_fn(instances, **kwargs)


@pytest.mark.parametrize(
    "instances, match",
    [
        ([_item(), [1, 2, 3]], r"sample 1: expected a dict with input_ids and labels, got list"),
        (
            [{"input_ids": [1.0, 2.0], "labels": [1, 2]}],
            r"sample 0, field 'input_ids': expected "
            r"integer values, got dtype torch.float32\. Tokenize",
        ),
        (
            [{"input_ids": torch.tensor([1, 2]), "labels": torch.tensor([True, True])}],
            r"sample 0, field 'labels': expected integer values, got dtype torch.bool",
        ),
    ],
)
def test_type_errors(instances, match):
    with pytest.raises(TypeError, match=match):
        rope_collate_fn(instances)


def test_drop_unsupervised_warns_with_count():
    items = [
        _item(),
        {"input_ids": [1, 2], "labels": [-100, -100]},
        {"input_ids": [5], "labels": [5]},
    ]
    with pytest.warns(
        UserWarning,
        match=r"dropped 2 of 3 samples with no supervised label "
        r"\(batch indices \[1, 2\]\)",
    ):
        data = rope_collate_fn(items, drop_unsupervised=True, return_hf_format=True)
    assert data["input_ids"].tolist() == [[1, 2, 3]]


def test_unsupervised_samples_are_kept_and_counted():
    # A 1-token sample and a reply masked away: no loss term, no harm, no warning by default.
    items = [
        _item(),
        {"input_ids": [1, 2], "labels": [-100, -100]},
        {"input_ids": [5], "labels": [5]},
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        data = rope_collate_fn(items, return_hf_format=True)
    assert data.pop("num_unsupervised") == 2
    assert data["input_ids"].tolist() == [[1, 2, 3], [1, 2, 0], [5, 0, 0]]
    assert data["labels"].tolist() == [[1, 2, 3], [-100] * 3, [5, -100, -100]]
    check_packed_batch(data)
