"""The one dialogue hash (``data.dialogue_keys``): the doctor's and the held-out figures' identity."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from xtuner_rope.data.dialogue_keys import key_bytes, segment_keys, sequences_key_bytes
from xtuner_rope.evaluation.heldout_counts import dialogue_keys, document_keys

PACKAGE = Path(__file__).resolve().parents[2] / "xtuner_rope"


def test_equal_ids_equal_keys_and_any_change_another_key():
    a, b = [5, 6, 7], [5, 6, 8]
    keys = sequences_key_bytes([a, b, a, [5, 6], [6, 5, 7], []])
    assert keys[0] == keys[2]
    assert len(set(keys)) == 5  # a changed token, a cut, a swap and the empty dialogue differ


def test_segments_of_a_stream_equal_the_sequences_alone():
    docs = [[1, 2, 3], [9], [4, 4, 4, 4], [1, 2, 3]]
    sizes = np.array([len(d) for d in docs])
    stream = np.concatenate([np.array(d) for d in docs])
    keys = segment_keys(stream, np.cumsum(sizes) - sizes)
    assert keys.shape == (4, 3) and keys[:, 2].tolist() == [3, 1, 4, 3]
    assert key_bytes(stream, np.cumsum(sizes) - sizes) == sequences_key_bytes(docs)


def test_held_out_figures_use_it():
    row = {"input_ids": [1, 2, 3, 9], "labels": [1, 2, 3, 9], "cumulative_len": [0, 3, 4]}
    assert document_keys([row]) == dialogue_keys([[1, 2, 3], [9]])


def test_the_package_has_one_dialogue_hash():
    """No other module keys token ids with a digest of its own (hashlib's are for file names)."""
    others = [
        p.relative_to(PACKAGE).as_posix()
        for p in PACKAGE.rglob("*.py")
        if p.name != "dialogue_keys.py"
        and re.search(r"blake2b|_HASH_BASES|splitmix", p.read_text(encoding="utf-8"))
    ]
    assert not others, f"a second dialogue hash in {others}: use data.dialogue_keys"
