"""Catalogue of bad and extreme inputs at every public entry point.

Each row of ``BAD`` is (entry point, positional args, keyword args, exception type, message
regex naming the field and the sample / row / document / column). Each row of ``EXTREME``
is (entry point, call, live reference): a valid input at the edge of what is accepted,
whose output must equal the reference's (XTuner's collate function, the InternLM2 classes
XTuner ships, our own flat-boundary builder).
"""

import numpy as np
import pytest
import torch
from mmengine import MessageHub
from runners import tiny_runner
from xtuner._lite.modelings.internlm2 import modeling_internlm2 as upstream
from xtuner.dataset.collate_fns import default_collate_fn

from xtuner_rope.batch.checks import check_packed_batch, row_boundaries
from xtuner_rope.data.collate import rope_collate_fn
from xtuner_rope.hooks import PackedBatchCheckHook, ValidatedRoPEHook
from xtuner_rope.models.internlm2_rope import ValidatedRotaryEmbedding
from xtuner_rope.models.runtime import VARLEN_HUB, batch_document_plan
from xtuner_rope.ops.packing import flat_cumulative
from xtuner_rope.ops.rope import apply_rotary_pos_emb


def it(ids, labels=None, **extra):
    """An XTuner item; labels default to the ids (all supervised)."""
    return {"input_ids": ids, "labels": list(ids) if labels is None else labels, **extra}


GOOD = it([1, 2, 3])
M = -100


def cus(row0, row1=(0, 6)):
    """A cumulative_len list for batch(): row 0's and row 1's boundaries."""
    return [torch.as_tensor(row0), torch.as_tensor(row1)]


def batch(**changes):
    """A valid check_packed_batch input (rows [3 + 2 | 1 pad], [4 | 2 pad]; s = 6), edited."""
    items = [
        it([1, 2, 3, 4, 5], [M, 2, 3, M, 5], cumulative_len=[0, 3, 5]),
        it([6, 7, 8, 9], [M, 7, 8, 9]),
    ]
    data = rope_collate_fn(items, min_length=6, return_hf_format=True)
    data.update(changes)
    return data


def hub_plan(cu, b, s):
    """document_plan with ``cu`` published in XTuner's MessageHub convention for this rank."""
    hub = MessageHub.get_instance(VARLEN_HUB)
    hub.update_info("cumulative_len_rank_0", cu)
    try:
        return batch_document_plan(None, b, s, torch.device("cpu"))
    finally:
        hub.update_info("cumulative_len_rank_0", None)


ROT = ValidatedRotaryEmbedding(8, max_position_embeddings=16)
X = torch.zeros(1, 2, 4, 8)  # value_states [b, n_kv, s, h_d]
Q, K = torch.randn(2, 2, 4, 8), torch.randn(2, 1, 4, 8)  # [b, n_h, s, h_d], [b, n_kv, s, h_d]
COS, SIN = ROT(Q, torch.arange(4)[None])  # [1, 4, 8]
POS = torch.tensor([[0, 1, 2, 3]])

# Row 0: a 2-token document and 10 padding tokens; row 1: a 10-token document (positions
# 0..9). The padding is cut shorter than that document, so an error about the RoPE range
# names the document (row 1, column 9), not the padding of row 0 that inherited its length.
PADDED = rope_collate_fn([it([1, 2]), it(list(range(1, 11)))], min_length=12, return_hf_format=True)
ROT8, X12 = ValidatedRotaryEmbedding(8, max_position_embeddings=8), torch.zeros(2, 2, 12, 8)
RANGE8 = r"beyond the supported range \[0, 8\)"

S0 = r"sample 0, field 'input_ids'"
CB = "check_packed_batch: "
HUB = r"MessageHub 'varlen_attn_args': cumulative_len"
BAD = [
    # ----- rope_collate_fn: ids and labels -----
    (
        rope_collate_fn,
        [[it(None, [1])]],
        {},
        TypeError,
        S0 + r": expected a list or tensor of ints, got NoneType None\. Tokenize",
    ),
    (
        rope_collate_fn,
        [[it("hello", [1])]],
        {},
        TypeError,
        S0 + r": expected a list or tensor of ints, got str 'hello'",
    ),
    (
        rope_collate_fn,
        [[GOOD, it([1, 2], b"ab")]],
        {},
        TypeError,
        r"sample 1, field 'labels': expected a list or tensor of ints, got bytes",
    ),
    (
        rope_collate_fn,
        [[it([1.0, 2.0], [1, 2])]],
        {},
        TypeError,
        S0 + r": expected integer values, got dtype torch\.float32",
    ),
    (
        rope_collate_fn,
        [[it([True, False], [1, 2])]],
        {},
        TypeError,
        S0 + r": expected integer values, got dtype torch\.bool",
    ),
    (
        rope_collate_fn,
        [[it([1 + 2j, 3j], [1, 2])]],
        {},
        TypeError,
        S0 + r": expected integer values, got dtype torch\.complex",
    ),
    (
        rope_collate_fn,
        [[it([1, None, 3], [1, 2, 3])]],
        {},
        TypeError,
        S0 + r": expected ints, got NoneType None at index 1",
    ),
    (
        rope_collate_fn,
        [[it([1, "a"], [1, 2])]],
        {},
        TypeError,
        S0 + r": expected ints, got str 'a' at index 1",
    ),
    (
        rope_collate_fn,
        [[it([[1, 2], [3]], [1, 2, 3])]],
        {},
        ValueError,
        S0 + r": expected a flat sequence of ints, got a nested list at index 0",
    ),
    (
        rope_collate_fn,
        [[it([[1, 2], [3, 4]], [[1, 2], [3, 4]])]],
        {},
        ValueError,
        S0 + r": expected a flat sequence of ints, got shape \[2, 2\]",
    ),
    (
        rope_collate_fn,
        [[it(torch.ones(1, 3, dtype=torch.long), [1, 1, 1])]],
        {},
        ValueError,
        S0 + r": expected a flat sequence of ints, got shape \[1, 3\]",
    ),
    (
        rope_collate_fn,
        [[it(5, [5])]],
        {},
        ValueError,
        S0 + r": expected a flat sequence of ints, got shape \[\]",
    ),
    (
        rope_collate_fn,
        [[it([1, 2**64], [1, 2])]],
        {},
        ValueError,
        S0 + r": expected ints in the int64 range, got 18446744073709551616 at index 1",
    ),
    (
        rope_collate_fn,
        [[it([-(2**63) - 1, 1], [1, 2])]],
        {},
        ValueError,
        S0 + r": expected ints in the int64 range, got -9223372036854775809 at index 0",
    ),
    (
        rope_collate_fn,
        [[GOOD, it([4, -1, 6])]],
        {},
        ValueError,
        r"sample 1, field 'input_ids': expected token ids >= 0 \(column 1\), got -1",
    ),
    (
        rope_collate_fn,
        [[it([4, 5, 6], [M, -5, 6])]],
        {},
        ValueError,
        r"sample 0, field 'labels': expected token ids >= 0 or -100 \(column 1\), got -5",
    ),
    (
        rope_collate_fn,
        [[GOOD, it([], [])]],
        {},
        ValueError,
        r"sample 1, field 'input_ids': expected at least 1 token, got 0 tokens",
    ),
    (
        rope_collate_fn,
        [[it([1, 2, 3], [1, 2])]],
        {},
        ValueError,
        r"sample 0, field 'labels': expected len\(labels\) == len\(input_ids\) == 3, got 2",
    ),
    (
        rope_collate_fn,
        [[{"input_ids": [1, 2]}]],
        {},
        ValueError,
        r"sample 0, field 'labels': expected a dict .*got keys \['input_ids'\]",
    ),
    (
        rope_collate_fn,
        [[GOOD, None]],
        {},
        TypeError,
        r"sample 1: expected a dict with input_ids and labels, got NoneType",
    ),
    (rope_collate_fn, [[GOOD, [1, 2]]], {}, TypeError, r"sample 1: expected a dict .*got list"),
    # ----- rope_collate_fn: the batch and the supervision policy -----
    (rope_collate_fn, [[]], {}, ValueError, r"got an empty batch \(0 samples\)"),
    (
        rope_collate_fn,
        [None],
        {},
        TypeError,
        r"expected a list of samples \(dicts\), got NoneType None",
    ),
    (rope_collate_fn, [GOOD], {}, TypeError, r"expected a list of samples \(dicts\), got dict"),
    (
        rope_collate_fn,
        [[it([7], [7]), it([1, 2], [1, M])]],
        {},
        ValueError,
        r"all 2 samples of the batch have no supervised label \(indices \[0, 1\]\): the mean "
        r"loss would be 0/0 = NaN.*filter such samples",
    ),
    (
        rope_collate_fn,
        [[it([7], [7]), it([1, 2], [M, M])]],
        {"drop_unsupervised": True},
        ValueError,
        r"all 2 samples of the batch have no supervised label \(indices \[0, 1\]\)",
    ),
    (
        rope_collate_fn,
        [[it([1, 2, 3], [M, M, M], cumulative_len=[0, 1, 2, 3])]],
        {},
        ValueError,
        r"all 1 samples of the batch have no supervised label \(indices \[0\]\)",
    ),
    # ----- rope_collate_fn: options -----
    (
        rope_collate_fn,
        [[GOOD], None],
        {},
        TypeError,
        r"option pad_index: expected an int token id >= 0, got NoneType None\. Pass the "
        r"tokenizer's pad_token_id",
    ),
    (
        rope_collate_fn,
        [[GOOD], -1],
        {},
        ValueError,
        r"option pad_index: expected an int token id >= 0 \(a row of the embedding\), got -1",
    ),
    (rope_collate_fn, [[GOOD], 0.0], {}, TypeError, r"option pad_index: .* got float 0\.0"),
    (rope_collate_fn, [[GOOD], True], {}, TypeError, r"option pad_index: .* got bool True"),
    (
        rope_collate_fn,
        [[GOOD]],
        {"max_length": 0},
        ValueError,
        r"option max_length: expected None or an int >= 1, got 0",
    ),
    (
        rope_collate_fn,
        [[GOOD]],
        {"max_length": 2.5},
        TypeError,
        r"option max_length: expected None or an int >= 1, got float 2\.5",
    ),
    (
        rope_collate_fn,
        [[GOOD]],
        {"pad_to_multiple_of": 0},
        ValueError,
        r"option pad_to_multiple_of: expected None or an int >= 1, got 0",
    ),
    (
        rope_collate_fn,
        [[GOOD]],
        {"pad_to_multiple_of": True},
        TypeError,
        r"option pad_to_multiple_of: expected None or an int >= 1, got bool True",
    ),
    (
        rope_collate_fn,
        [[GOOD]],
        {"min_length": -1},
        ValueError,
        r"option min_length: expected None or an int >= 0, got -1",
    ),
    (
        rope_collate_fn,
        [[GOOD]],
        {"pack": "yes"},
        TypeError,
        r"option pack: expected True or False, got str 'yes'",
    ),
    (
        rope_collate_fn,
        [[GOOD]],
        {"drop_unsupervised": None},
        TypeError,
        r"option drop_unsupervised: expected True or False, got NoneType",
    ),
    (
        rope_collate_fn,
        [[GOOD]],
        {"pack": True},
        ValueError,
        r"option max_length: expected an int when pack=True, got None",
    ),
    (
        rope_collate_fn,
        [[GOOD, it([1, 2, 3, 4])]],
        {"pack": True, "max_length": 3},
        ValueError,
        r"sample 1, field 'input_ids': expected at most max_length=3 tokens, got 4",
    ),
    # ----- rope_collate_fn: packed items' boundaries and positions -----
    (
        rope_collate_fn,
        [[it([1, 2, 3], cumulative_len=[0, 1.5, 3])]],
        {},
        TypeError,
        r"sample 0, field 'cumulative_len': expected integer values, got dtype torch\.float32",
    ),
    (
        rope_collate_fn,
        [[it([1, 2, 3], cumulative_len=[0, 2, 1, 3])]],
        {},
        ValueError,
        r"sample 0, document 1, field 'cumulative_len': expected strictly increasing .* "
        r"cumulative_len\[1:3\] = \[2, 1\]",
    ),
    (
        rope_collate_fn,
        [[it([1, 2, 3], cumulative_len=[0, 2, 2, 3])]],
        {},
        ValueError,
        r"sample 0, document 1, field 'cumulative_len': expected strictly increasing",
    ),
    (
        rope_collate_fn,
        [[it([1, 2, 3], cumulative_len=[0, 2])]],
        {},
        ValueError,
        r"sample 0, field 'cumulative_len': expected last boundary == len\(input_ids\) == 3, got 2",
    ),
    (
        rope_collate_fn,
        [[it([1, 2, 3], cumulative_len=[[0, 3]])]],
        {},
        ValueError,
        r"sample 0, field 'cumulative_len': expected a flat sequence of ints, got shape \[1, 2\]",
    ),
    (
        rope_collate_fn,
        [[it([1, 2, 3], cumulative_len="0,3")]],
        {},
        TypeError,
        r"sample 0, field 'cumulative_len': expected a list or tensor of ints, got str",
    ),
    (
        rope_collate_fn,
        [[it([1, 2, 3, 4], cumulative_len=[0, 2, 4], position_ids=[0, 1, 2, 3])]],
        {},
        ValueError,
        r"sample 0, document 1, field 'position_ids': expected 0 at column 2",
    ),
    (
        rope_collate_fn,
        [[it([1, 2, 3], position_ids=[0, -1, 1])]],
        {},
        ValueError,
        r"sample 0, document 0, field 'position_ids': expected 1 at column 1 .*got -1",
    ),
    (
        rope_collate_fn,
        [[it([1, 2, 3], position_ids=[0, 1])]],
        {},
        ValueError,
        r"sample 0, field 'position_ids': expected len\(input_ids\) == 3 entries, got 2",
    ),
    (
        rope_collate_fn,
        [[it([1, 2, 3], position_ids=[0.0, 1.0, 2.0])]],
        {},
        TypeError,
        r"sample 0, field 'position_ids': expected integer values, got dtype torch\.float32",
    ),
    # ----- check_packed_batch / row_boundaries -----
    (check_packed_batch, [None], {}, TypeError, CB + r"expected the batch dict .*got NoneType"),
    (
        check_packed_batch,
        [batch(input_ids=[[1, 2]])],
        {},
        TypeError,
        r"field 'input_ids': expected a tensor of dtype torch\.int64, got list",
    ),
    (
        check_packed_batch,
        [batch()],
        {"vocab_size": 9},
        ValueError,
        r"row 1, document 0, field 'input_ids': expected ids in \[0, 9\) \(column 3\), got 9",
    ),
    (
        check_packed_batch,
        [batch(labels=torch.tensor([[M, 2, 3, M, -7, M], [M, 7, 8, 9, M, M]]))],
        {},
        ValueError,
        r"row 0, document 1, field 'labels': expected ids >= 0 or -100 \(column 4\)",
    ),
    (
        check_packed_batch,
        [batch(labels=torch.tensor([[M, 2, 3, M, 5, M], [M, 7, 80, 9, M, M]]))],
        {"vocab_size": 10},
        ValueError,
        r"row 1, document 0, field 'labels': expected ids in \[0, 10\) or -100 \(column 2\), got 80",
    ),
    (
        check_packed_batch,
        [batch(cumulative_len=cus([0.0, 3, 5, 6]))],
        {},
        TypeError,
        r"row 0, field 'cumulative_len': expected integer values, got dtype "
        r"torch\.float32",
    ),
    (
        check_packed_batch,
        [batch(cumulative_len=cus([0, 5, 3, 6]))],
        {},
        ValueError,
        r"row 0, document 1, field 'cumulative_len': expected strictly increasing "
        r".*\[5, 3\]",
    ),
    (
        check_packed_batch,
        [batch(cumulative_len=cus([0, 3, 3, 6]))],
        {},
        ValueError,
        r"row 0, document 1, field 'cumulative_len': expected strictly increasing",
    ),
    (
        check_packed_batch,
        [batch(cumulative_len=cus([0, 3, 5]))],
        {},
        ValueError,
        r"row 0, field 'cumulative_len': expected boundaries that end at s=6",
    ),
    (
        check_packed_batch,
        [batch(cumulative_len=torch.zeros(2, 1, 3, dtype=torch.int32))],
        {},
        ValueError,
        r"field 'cumulative_len': expected a list of 1-D tensors, or a \[b, k\] tensor, "
        r"got shape \[2, 1, 3\]",
    ),
    (
        check_packed_batch,
        [batch(cumulative_len=cus([[0, 3], [3, 6]]))],
        {},
        ValueError,
        r"row 0, field 'cumulative_len': expected a 1-D tensor per row, got shape "
        r"\[2, 2\]",
    ),
    (
        check_packed_batch,
        [batch(cumulative_len="0,6")],
        {},
        TypeError,
        r"field 'cumulative_len': expected a list of tensors, got str",
    ),
    (
        check_packed_batch,
        [batch(cumulative_len=[torch.tensor([0, 6]), None])],
        {},
        TypeError,
        r"row 1, field 'cumulative_len': expected a list or tensor of ints, got NoneType",
    ),
    (
        check_packed_batch,
        [
            batch(
                cumulative_len=None,
                position_ids=torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 5, 0]]),
            )
        ],
        {},
        ValueError,
        r"row 1, document 0, field 'position_ids': expected 4 at column 4",
    ),
    (
        check_packed_batch,
        [batch()],
        {"max_position": 3},
        ValueError,
        r"row 1, document 0, field 'position_ids': expected positions < max_position=3",
    ),
    (
        check_packed_batch,
        [batch(max_seqlen="4")],
        {},
        TypeError,
        r"field 'max_seqlen': expected an int, got str '4'",
    ),
    (
        check_packed_batch,
        [batch(num_unsupervised=-1)],
        {},
        TypeError,
        r"field 'num_unsupervised': expected an int >= 0 .*got int -1",
    ),
    (
        check_packed_batch,
        [batch(labels=torch.full((2, 6), M))],
        {},
        ValueError,
        r"field 'labels': expected at least one supervised label \(!= -100\) after column 0, got "
        r"none in rows \[0, 1\] \(the mean loss would be 0/0 = NaN\)",
    ),
    (
        check_packed_batch,
        [batch(attention_mask=torch.tensor([[True] * 6, [False] * 6]))],
        {},
        ValueError,
        r"row 1, field 'attention_mask': expected at least one attended token per row",
    ),
    (
        row_boundaries,
        [batch(), 3],
        {},
        ValueError,
        r"field 'cumulative_len': expected one boundary tensor per row \(3\), got 2",
    ),
    # ----- document_plan: boundaries published in the MessageHub -----
    (
        hub_plan,
        [torch.tensor([0, 3, 6, 8], dtype=torch.int32), 2, 4],
        {},
        ValueError,
        HUB + r": document 1 spans tokens \[3, 6\), across the end of row 0 at 4 = 1\*s",
    ),
    (
        hub_plan,
        [[0, 3, 8], 2, 4],
        {},
        ValueError,
        HUB + r": document 1 spans tokens \[3, 8\), across the end of row 0",
    ),
    (
        hub_plan,
        [torch.tensor([0, 5, 2, 8]), 2, 4],
        {},
        ValueError,
        HUB + r": expected strictly increasing boundaries, got cumulative_len\[1:3\] = \[5, 2\]",
    ),
    (
        hub_plan,
        [torch.tensor([0, 4, 4, 8]), 2, 4],
        {},
        ValueError,
        HUB + r": expected strictly increasing boundaries, got cumulative_len\[1:3\] = \[4, 4\]",
    ),
    (
        hub_plan,
        [torch.tensor([0, 4, 6]), 2, 4],
        {},
        ValueError,
        HUB + r" \[0, 4, 6\]\.\.\. starting at 0 and ending at 6, but the attention input has b\*s "
        r"= 2\*4 = 8 tokens",
    ),
    (
        hub_plan,
        [torch.tensor([0.0, 4.0, 8.0]), 2, 4],
        {},
        TypeError,
        HUB + r": expected integer values, got dtype torch\.float32",
    ),
    (
        hub_plan,
        [torch.tensor([0, -3, 4, 8]), 2, 4],
        {},
        ValueError,
        HUB + r": expected strictly increasing boundaries, got cumulative_len\[0:2\] = \[0, -3\]",
    ),
    (hub_plan, [torch.tensor([-4, 4, 8]), 2, 4], {}, ValueError, HUB + r".* starting at -4"),
    (
        hub_plan,
        [torch.tensor([[0, 4, 8]]), 2, 4],
        {},
        ValueError,
        HUB + r": expected a 1-D tensor \[0, \.\.\., b\*s\] .*got shape \[1, 3\]",
    ),
    (
        hub_plan,
        ["0,4,8", 2, 4],
        {},
        TypeError,
        HUB + r": expected a list or tensor of ints, got str '0,4,8'",
    ),
    # ----- ValidatedRotaryEmbedding.forward (limit 16) -----
    (
        ROT,
        [X, torch.tensor([[0, 1, -1, 2]])],
        {},
        ValueError,
        r"position_ids must be non-negative, got -1 at row 0, column 2",
    ),
    (
        ROT,
        [X, torch.tensor([[0, 1, 2, 16]])],
        {},
        ValueError,
        r"position_ids holds 16 at row 0, column 3, beyond the supported range \[0, 16\) "
        r"\(max_position_embeddings=16\)",
    ),
    (ROT, [X, POS.float()], {}, TypeError, r"integer tensor \(torch\.long\), got torch\.float32"),
    (ROT, [X, POS[0]], {}, ValueError, r"2-D \[b, s\], got shape \(4,\)"),
    (
        ROT,
        [X, POS[:, :3]],
        {},
        ValueError,
        r"position_ids has shape \(1, 3\) but the activations have batch 1 and sequence length 4",
    ),
    (
        ROT,
        [X, torch.zeros(2, 4, dtype=torch.long)],
        {},
        ValueError,
        r"shape \(2, 4\) .*expected \(1, 4\) or \(1, 4\)",
    ),
    (ROT, [X, [[0, 1, 2, 3]]], {}, TypeError, r"position_ids must be a torch\.Tensor, got list"),
    (ROT, [X, True], {}, TypeError, r"position_ids must be a torch\.Tensor, got bool"),
    (ROT, [X, POS.to("meta")], {}, ValueError, r"position_ids is a meta tensor"),
    (ROT, [[0.0] * 4, POS], {}, TypeError, r"needs x = value_states .*got list"),
    (ROT, [X], {"seq_len": 17}, ValueError, r"seq_len=17 is beyond the supported range of 16"),
    # ----- errors about the RoPE range name the document, never the padding after it -----
    (
        check_packed_batch,
        [PADDED],
        {"max_position": 8},
        ValueError,
        r"row 1, document 0, field 'position_ids': expected positions < max_position=8 .*got 9",
    ),
    (
        ROT8,
        [X12, PADDED["position_ids"]],
        {},
        ValueError,
        r"position_ids holds 9 at row 1, column 9, " + RANGE8,
    ),
    # ----- PackedBatchCheckHook: the batch's structure -----
    (
        PackedBatchCheckHook().before_train_iter,
        [None, 0, {"data": [1, 2]}],
        {},
        TypeError,
        r"PackedBatchCheckHook: field 'data' of the batch: expected a dict of tensors .*got list "
        r"\[1, 2\]",
    ),
    (
        PackedBatchCheckHook().before_train_iter,
        [None, 0, {"inputs": {}}],
        {},
        TypeError,
        r"field 'data' of the batch: expected a dict .*got keys \['inputs'\]",
    ),
    (
        PackedBatchCheckHook().before_train_iter,
        [None, 0, ("data", {})],
        {},
        TypeError,
        r"PackedBatchCheckHook: expected an XTuner batch .*got tuple \('data', \{\}\)",
    ),
    # ----- apply_rotary_pos_emb (q [2, 2, 4, 8]) -----
    (
        apply_rotary_pos_emb,
        [Q, K, COS[:, :3], SIN[:, :3]],
        {},
        ValueError,
        r"cos/sin \(1, 3, 8\) do not match q \(2, 2, 4, 8\): expected \[1, 4, 8\] or \[2, 4, 8\]",
    ),
    (
        apply_rotary_pos_emb,
        [Q, K, COS.expand(3, 4, 8), SIN.expand(3, 4, 8)],
        {},
        ValueError,
        r"cos/sin \(3, 4, 8\) do not match q",
    ),
    (
        apply_rotary_pos_emb,
        [Q[:1], K[:1], COS.expand(2, 4, 8), SIN.expand(2, 4, 8)],
        {},
        ValueError,
        r"cos/sin \(2, 4, 8\) do not match q \(1, 2, 4, 8\)",
    ),
    (
        apply_rotary_pos_emb,
        [Q, K, COS.long(), SIN.long()],
        {},
        TypeError,
        r"cos must be a floating-point tensor, got torch\.int64",
    ),
    (
        apply_rotary_pos_emb,
        [Q, K, COS.to(torch.complex64), SIN],
        {},
        TypeError,
        r"cos must be a floating-point tensor, got torch\.complex64",
    ),
    (
        apply_rotary_pos_emb,
        [Q, K, COS, SIN[:, :, :6]],
        {},
        ValueError,
        r"sin \(1, 4, 6\) must have the shape of cos \(1, 4, 8\)",
    ),
    (
        apply_rotary_pos_emb,
        [Q, K[:1], COS, SIN],
        {},
        ValueError,
        r"k \(1, 1, 4, 8\) must have the batch 2 and sequence length 4 of q",
    ),
    (
        apply_rotary_pos_emb,
        [Q, K, COS, SIN],
        {"unsqueeze_dim": 3},
        ValueError,
        r"heads at unsqueeze_dim 1 .* or 2 .*unsqueeze_dim=3",
    ),
    (
        apply_rotary_pos_emb,
        [Q[..., :7], K[..., :7], COS[..., :7], SIN[..., :7]],
        {},
        ValueError,
        r"one even head dim h_d",
    ),
    (
        apply_rotary_pos_emb,
        [Q, K, COS[0], SIN[0], POS + 1],
        {},
        ValueError,
        r"holds 4 at row 0, column 3, beyond the supported range \[0, 4\) \(rows of the 4-row",
    ),
    (
        apply_rotary_pos_emb,
        [Q.tolist(), K, COS, SIN],
        {},
        TypeError,
        r"q must be a floating-point tensor, got list",
    ),
]


BAD_IDS = [f"{i}-{getattr(row[0], '__name__', 'rotary')}" for i, row in enumerate(BAD)]


@pytest.mark.parametrize("entry, args, kwargs, error, match", BAD, ids=BAD_IDS)
def test_bad_input_is_named(entry, args, kwargs, error, match):
    with pytest.raises(error, match=match):
        entry(*args, **kwargs)


def _xtuner(items, **kw):
    return default_collate_fn(items, return_hf_format=True, **kw)


def _keys(data, *keys):
    return {k: data[k] for k in keys}


def _rotary_ref(pos):
    ref = upstream.InternLM2RotaryEmbedding(8, max_position_embeddings=16)
    return ref(torch.zeros(1, 2, pos.shape[-1], 8), pos)


def _hub_ref(lengths_per_row, s):
    rows = [torch.tensor([0, *np.cumsum(r)], dtype=torch.int32) for r in lengths_per_row]
    return flat_cumulative(rows, s)


ONE_TOKEN_DOCS = it(
    [1, 2, 3, 4, 5], [M, M, M, M, 5], cumulative_len=[0, 1, 2, 3, 5], position_ids=[0, 0, 0, 0, 1]
)
EXTREME = [
    # 1-token samples beside a supervised one: kept as rows, like XTuner's own collate.
    (
        "rope_collate_fn",
        lambda: _keys(
            rope_collate_fn([it([5], [5]), GOOD, it([9], [M])], return_hf_format=True),
            "input_ids",
            "labels",
            "attention_mask",
        ),
        lambda: _keys(
            _xtuner([it([5], [5]), GOOD, it([9], [M])]), "input_ids", "labels", "attention_mask"
        ),
    ),
    # ids as numpy int64 / tuple / int32 tensor / uint8 tensor, and an id of 2**62.
    (
        "rope_collate_fn",
        lambda: _keys(
            rope_collate_fn(
                [
                    it(np.array([1, 2**62]), (3, 4)),
                    it(
                        torch.tensor([7, 8, 9], dtype=torch.int32),
                        torch.tensor([7, 8, 9], dtype=torch.uint8),
                    ),
                ],
                return_hf_format=True,
            ),
            "input_ids",
            "labels",
            "attention_mask",
        ),
        lambda: _keys(
            _xtuner([it([1, 2**62], [3, 4]), it([7, 8, 9])]),
            "input_ids",
            "labels",
            "attention_mask",
        ),
    ),
    # A sample of exactly max_length, packed: one full row, no padding segment.
    (
        "rope_collate_fn",
        lambda: _keys(
            rope_collate_fn(
                [it(list(range(1, 9)))], pack=True, max_length=8, return_hf_format=True
            ),
            "input_ids",
            "labels",
            "position_ids",
        ),
        lambda: _keys(_xtuner([it(list(range(1, 9)))]), "input_ids", "labels", "position_ids"),
    ),
    # An XTuner-packed item of 1-token documents: XTuner's varlen collate, first labels masked.
    (
        "rope_collate_fn",
        lambda: _keys(
            rope_collate_fn([ONE_TOKEN_DOCS], return_hf_format=True),
            "input_ids",
            "position_ids",
            "max_seqlen",
        ),
        lambda: _keys(
            _xtuner([ONE_TOKEN_DOCS], use_varlen_attn=True),
            "input_ids",
            "position_ids",
            "max_seqlen",
        ),
    ),
    # check_packed_batch returns nothing to compare: its edge cases are in EDGE below.
    # Hub boundaries: rows of 1-token documents, and one document per row.
    (
        "document_plan",
        lambda: hub_plan(_hub_ref([[1, 1, 1], [2, 1], [3]], 3), 3, 3).cu_seqlens,
        lambda: _hub_ref([[1, 1, 1], [2, 1], [3]], 3),
    ),
    (
        "document_plan",
        lambda: hub_plan([0, 5, 10], 2, 5).cu_seqlens,
        lambda: torch.tensor([0, 5, 10], dtype=torch.int32),
    ),
    # RoPE: positions up to limit - 1, a 1-token sequence, int32 positions.
    (
        "ValidatedRotaryEmbedding",
        lambda: ROT(torch.zeros(1, 2, 5, 8), torch.tensor([[0, 15, 3, 15, 1]])),
        lambda: _rotary_ref(torch.tensor([[0, 15, 3, 15, 1]])),
    ),
    (
        "ValidatedRotaryEmbedding",
        lambda: ROT(torch.zeros(1, 2, 1, 8), torch.tensor([[0]])),
        lambda: _rotary_ref(torch.tensor([[0]])),
    ),
    (
        "ValidatedRotaryEmbedding",
        lambda: ROT(torch.zeros(1, 2, 3, 8), torch.tensor([[2, 0, 1]], dtype=torch.int32)),
        lambda: _rotary_ref(torch.tensor([[2, 0, 1]])),
    ),
    # apply_rotary_pos_emb: cos/sin of batch 1 broadcast, the [b, s, n_h, h_d] layout, bf16 cos.
    (
        "apply_rotary_pos_emb",
        lambda: apply_rotary_pos_emb(Q, K, COS, SIN),
        lambda: upstream.apply_rotary_pos_emb(Q, K, COS, SIN),
    ),
    (
        "apply_rotary_pos_emb",
        lambda: apply_rotary_pos_emb(
            Q.transpose(1, 2), K.transpose(1, 2), COS, SIN, unsqueeze_dim=2
        ),
        lambda: upstream.apply_rotary_pos_emb(
            Q.transpose(1, 2), K.transpose(1, 2), COS, SIN, unsqueeze_dim=2
        ),
    ),
    (
        "apply_rotary_pos_emb",
        lambda: apply_rotary_pos_emb(Q, K, COS.bfloat16(), SIN.bfloat16()),
        lambda: upstream.apply_rotary_pos_emb(Q, K, COS.bfloat16().float(), SIN.bfloat16().float()),
    ),
]


@pytest.mark.parametrize(
    "entry, ours, reference", EXTREME, ids=[f"{i}-{r[0]}" for i, r in enumerate(EXTREME)]
)
def test_extreme_valid_input_matches_reference(entry, ours, reference):
    torch.testing.assert_close(ours(), reference(), atol=1e-6, rtol=1e-6)


UNSUPERVISED_ROW = torch.tensor([[M] * 6, [M, M, M, 9, M, M]])
ONE_ROW, I32 = rope_collate_fn([GOOD], return_hf_format=True), torch.int32
# check_packed_batch at the edge of what it accepts: (accepted call, the same batch one step
# past the edge, the error that step gets), so that each acceptance is shown to be the edge.
EDGE = [
    # A document exactly at the RoPE limit (positions 0..3), then a limit one lower.
    (
        lambda: check_packed_batch(batch(), max_position=4),
        lambda: check_packed_batch(batch(), max_position=3),
        r"row 1, document 0, field 'position_ids': expected positions < max_position=3",
    ),
    # A row without supervision beside one supervised label; then no supervised label at all.
    (
        lambda: check_packed_batch(batch(labels=UNSUPERVISED_ROW, num_unsupervised=1)),
        lambda: check_packed_batch(batch(labels=torch.full((2, 6), M), num_unsupervised=1)),
        r"field 'labels': expected at least one supervised label .* got none in rows \[0, 1\]",
    ),
    # One row: cumulative_len may be one tensor, not a list; it must still end at s.
    (
        lambda: check_packed_batch({**ONE_ROW, "cumulative_len": torch.tensor([0, 3], dtype=I32)}),
        lambda: check_packed_batch({**ONE_ROW, "cumulative_len": torch.tensor([0, 2], dtype=I32)}),
        r"row 0, field 'cumulative_len': expected boundaries that end at s=3, got \[0, 2\]",
    ),
]


@pytest.mark.parametrize("accepted, past_edge, match", EDGE, ids=range(len(EDGE)))
def test_edge_batches_are_accepted_and_one_step_past_refused(accepted, past_edge, match):
    assert accepted() is None
    with pytest.raises(ValueError, match=match):
        past_edge()


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_padding_beyond_the_rope_range_trains_like_documents_alone(attn, tmp_path):
    """pad_to_multiple_of makes s = 32 with an 8-position RoPE: the padding is cut into
    segments of at most the longest document (8), the batch passes the hook, and every
    document gets the logits it gets alone from the unpatched model."""
    import copy

    runner = tiny_runner(tmp_path, attn=attn)  # a real Runner; the plugin's hooks patch it
    tiny_model = runner.model.llm
    ref = copy.deepcopy(tiny_model)
    ValidatedRoPEHook(max_position=8).before_train(runner)
    docs = [torch.randint(3, 256, (n,)) for n in (8, 5, 1, 7, 3)]
    batch = rope_collate_fn(
        [it(d.tolist()) for d in docs], pack=True, max_length=16, pad_to_multiple_of=32
    )
    data = batch["data"]
    assert data["input_ids"].shape[1] == 32 and data["max_seqlen"] == 8
    assert data["num_unsupervised"] == 1  # the 1-token document, kept
    rows = [cu.tolist() for cu in data["cumulative_len"]]
    hook = PackedBatchCheckHook()
    hook.before_train(runner)
    hook.before_train_iter(runner, 0, batch)
    try:
        logits = tiny_model(**data).logits
    finally:
        hook.after_train_iter(runner, 0, batch)
    ids, found = data["input_ids"], 0
    for r, cu in enumerate(rows):
        for start, end in zip(cu[:-1], cu[1:]):
            doc = ids[r, start:end]
            assert end - start <= 8  # padding segments included
            if bool((doc == 0).all()):
                continue  # padding
            found += 1
            torch.testing.assert_close(
                logits[r, start:end], ref(doc[None]).logits[0], atol=1e-5, rtol=0
            )
    assert found == len(docs)
