"""The doctor at scale: its column scan and token keys against the per-item references, and
its progress on a dataset past one block (``tools/bench/doctor_scale.py`` measures the time)."""

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from datasets import Dataset
from sample_kinds import SAMPLE_KINDS

from xtuner_rope.data.dialogue_keys import segment_keys
from xtuner_rope.data.packed_dataset import pack_dataset
from xtuner_rope.doctor.packing import packing_figures
from xtuner_rope.doctor.progress import Progress
from xtuner_rope.doctor.scan_columns import is_scannable, scan_columns
from xtuner_rope.doctor.stats import scan_samples
from xtuner_rope.doctor.token_columns import TOKENS_PER_BLOCK, whole_matches

ROWS = SAMPLE_KINDS  # every kind of sample scan_samples tells apart
BOUNDS = {  # per row: XTuner's packed boundaries, odd ones included (repeats, past the end)
    "cumulative_len": [[0, 1, 3], [0], [0, 2], [0, 2, 2, 4], [0, 3, 6], [], [0, 4, 9]],
    "position_ids": [[0, 0, 1], [], [1, 2], [0, 1, 0, 1], [0, 1, 0, 1, 2, 0], [1], [2, 0, 1, 0, 1]],
}


def _scans(dataset: Dataset):
    """The column scan and the per-item scan of one dataset, same arguments."""
    kwargs = {"collate_max_length": 5, "truncation_length": 5}
    fast = scan_columns(dataset, progress=Progress(False), **kwargs)
    slow = scan_samples([dataset[i] for i in range(len(dataset))], progress=False, **kwargs)
    return fast, slow


@pytest.mark.parametrize("bounds", [None, "cumulative_len", "position_ids"])
@pytest.mark.parametrize("shuffled", [False, True])
def test_the_column_scan_equals_the_item_scan(bounds, shuffled):
    columns = {k: [r[k] for r in ROWS] for k in ("input_ids", "labels")}
    if bounds:
        columns[bounds] = BOUNDS[bounds]
    dataset = Dataset.from_dict(columns)
    dataset = dataset.shuffle(seed=3) if shuffled else dataset
    assert is_scannable(dataset)
    fast, slow = _scans(dataset)
    assert fast.lengths == slow.lengths and fast.supervised == slow.supervised
    assert fast.documents == slow.documents
    assert {k: vars(v) for k, v in fast.issues.items()} == {
        k: vars(v) for k, v in slow.issues.items()
    }
    assert sum(v.count for v in fast.issues.values()) >= 5  # every kind is there


def test_only_integer_token_lists_take_the_column_scan():
    assert not is_scannable(ROWS)
    assert not is_scannable(Dataset.from_dict({"input_ids": [[1]], "labels": [["a"]]}))
    assert not is_scannable(Dataset.from_dict({"input_ids": [[1], None], "labels": [[1], [2]]}))


def test_documents_are_matched_whole_once_and_in_order():
    a, b, c = [5, 6, 7], [7, 6, 5], [5, 6, 8]  # b: a's tokens in another order
    dialogues = [a, b, a]
    segments = [a, a, a, c, b, []]
    keys = [
        segment_keys(np.asarray(sum(docs, []), dtype=np.int64), np.cumsum([0] + docs_len[:-1]))
        for docs, docs_len in (
            (dialogues, [len(d) for d in dialogues]),
            (segments, [len(s) for s in segments]),
        )
    ]
    assert len({tuple(k) for k in keys[1][:5].tolist()}) == 3  # a (three times), c, b
    assert whole_matches(*keys).tolist() == [True, True, False, False, True, False]


def _big_dialogues(n: int, seed: int = 0) -> Dataset:
    """``n`` tokenized dialogues of 60-140 tokens, prompts -100, built from Arrow arrays."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(60, 141, n)
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]), pa.int32())
    ids = rng.integers(3, 90_000, int(lengths.sum()))
    prompt = np.repeat(lengths // 3, lengths)
    position = np.arange(len(ids)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    labels = np.where(position < prompt, -100, ids)
    return Dataset(
        pa.table(
            {
                "input_ids": pa.ListArray.from_arrays(offsets, pa.array(ids)),
                "labels": pa.ListArray.from_arrays(offsets, pa.array(labels)),
            }
        )
    )


def test_progress_shows_on_a_dataset_past_one_block(capsys):
    dialogues = _big_dialogues(24_000)  # ~2.4M tokens: more than one block
    tokens = len(pc.list_flatten(dialogues.data.table.column("input_ids")))
    assert tokens > TOKENS_PER_BLOCK
    packed = pack_dataset(dialogues, 2048, True, False, 1)
    capsys.readouterr()
    figures = packing_figures(dialogues, packed, 2048, progress=Progress())
    scan = scan_columns(
        packed, collate_max_length=None, truncation_length=None, progress=Progress()
    )
    err = capsys.readouterr().err
    assert f"doctor: packing figures: 24000 dialogues, {tokens} tokens, {len(packed)} rows (" in err
    assert "doctor: packing figures, 24000 dialogues: 100%" in err  # the pass's bar, to the end
    assert f"doctor: samples, {len(packed)} rows: 100%" in err
    assert figures["tokens"] == {"before": tokens, "after": tokens, "lost": 0}
    assert figures["cut_dialogues"] == 0 == figures["pieces"]
    assert scan.documents == 24_000 and sum(scan.lengths) == tokens
    quiet = packing_figures(dialogues, packed, 2048)  # the default: nothing on stderr
    assert quiet == figures and capsys.readouterr().err == ""


def test_no_bar_on_a_dataset_within_one_block(capsys):
    dialogues = _big_dialogues(300)
    packed = pack_dataset(dialogues, 2048, True, False, 1)
    capsys.readouterr()
    packing_figures(dialogues, packed, 2048, progress=Progress())
    err = capsys.readouterr().err
    assert err.startswith("doctor: packing figures: 300 dialogues, ") and err.count("\n") == 1
