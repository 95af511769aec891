"""Gathering token pieces chunk by chunk equals a take from the joined columns."""

import sys

import numpy as np
import pyarrow as pa
import pytest

from xtuner_rope.data import token_gather
from xtuner_rope.data.pack_plans import token_indices
from xtuner_rope.data.token_gather import TokenGather, drop_mapped_pages, list_lengths


def _table(lengths, chunk, labels_shift=0):
    rng = np.random.default_rng(0)
    batches = []
    for first in range(0, len(lengths), chunk):
        part = np.asarray(lengths[first : first + chunk])
        offsets = pa.array(np.concatenate([[0], np.cumsum(part)]), pa.int32())
        ids = rng.integers(0, 1000, int(part.sum()))
        labels = np.concatenate([ids, np.full(labels_shift, -100)]) if labels_shift else -ids
        label_offsets = offsets
        if labels_shift:  # the first dialogue of the chunk gets extra labels
            label_offsets = pa.array(
                np.concatenate([[0], np.cumsum(part) + labels_shift]), pa.int32()
            )
        batches.append(
            pa.record_batch(
                {
                    "input_ids": pa.ListArray.from_arrays(offsets, pa.array(ids)),
                    "labels": pa.ListArray.from_arrays(label_offsets, pa.array(labels)),
                }
            )
        )
    return pa.Table.from_batches(batches)


@pytest.mark.parametrize("chunk", [1, 3, 50])
def test_pieces_in_any_order_equal_a_take_from_the_joined_columns(chunk):
    lengths = np.random.default_rng(1).integers(1, 9, 40)
    table = _table(lengths, chunk)
    doc_starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    pick = np.random.default_rng(2).permutation(40)[:25]
    starts, sizes = doc_starts[pick] + 0, lengths[pick]
    got = TokenGather(table, ("input_ids", "labels")).gather(starts, sizes)
    for k in ("input_ids", "labels"):
        joined = table.column(k).combine_chunks().flatten().to_numpy()
        np.testing.assert_array_equal(got[k], joined[token_indices(starts, sizes)])
    assert got["input_ids"].dtype == np.int64


def test_labels_of_another_length_are_refused():
    with pytest.raises(ValueError, match="'labels' holds a different number of tokens"):
        TokenGather(_table([2, 3], 2, labels_shift=1), ("input_ids", "labels"))


def _resident_kib(path):
    """Resident KiB of this process's mappings of ``path`` (Linux /proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields[0].split("-")) == 2 and ":" not in fields[0]:
                inside = len(fields) == 6 and fields[5] == str(path)
            elif inside and fields[0] == "Rss:":
                total += int(fields[1])
    return total


@pytest.fixture
def release(monkeypatch):
    """Mapped pages released once read (the default, whatever the environment says)."""
    monkeypatch.delenv(token_gather.RELEASE_PAGES_ENV, raising=False)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps is Linux's")
def test_dropping_mapped_pages_frees_them_and_keeps_the_data(tmp_path, monkeypatch):
    """``XTUNER_ROPE_RELEASE_PAGES=0``: the pages stay (the kernel's to reclaim); else released."""
    path = (tmp_path / "tokens.bin").resolve()
    values = np.arange(1 << 20, dtype=np.int64)  # 8 MiB
    values.tofile(path)
    mapped = pa.memory_map(str(path))
    view = np.frombuffer(mapped.read_buffer(), dtype=np.int64)
    assert int(view.sum()) == int(values.sum()) and _resident_kib(path) >= 4096
    monkeypatch.setenv(token_gather.RELEASE_PAGES_ENV, "0")
    drop_mapped_pages([str(path)])
    assert _resident_kib(path) >= 4096  # turned off: nothing released
    monkeypatch.delenv(token_gather.RELEASE_PAGES_ENV)  # the default
    drop_mapped_pages([str(tmp_path / ".." / tmp_path.name / "tokens.bin")])
    assert _resident_kib(path) == 0
    np.testing.assert_array_equal(view, values)  # read again from the file


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps is Linux's")
def test_a_gather_from_a_mapped_file_leaves_its_token_pages_released(tmp_path, release):
    lengths = np.random.default_rng(3).integers(100, 400, 8000)
    path = (tmp_path / "tokenized.arrow").resolve()
    table = _table(lengths, 500)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    mapped = pa.ipc.open_stream(pa.memory_map(str(path))).read_all()
    doc_starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    pick = np.random.default_rng(4).permutation(len(lengths))
    got = TokenGather(mapped, ("input_ids", "labels"), (str(path),)).gather(
        doc_starts[pick], lengths[pick]
    )
    np.testing.assert_array_equal(
        got["labels"],
        table.column("labels")
        .combine_chunks()
        .flatten()
        .to_numpy()[token_indices(doc_starts[pick], lengths[pick])],
    )
    # Every token page was read, and released after: only the batches' offsets stay resident.
    assert _resident_kib(path) * 1024 < path.stat().st_size / 10


def _mapped_table(tmp_path, lengths, chunk):
    path = (tmp_path / "tokenized.arrow").resolve()
    table = _table(lengths, chunk)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return path, table, pa.ipc.open_stream(pa.memory_map(str(path))).read_all()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/maps is Linux's")
@pytest.mark.parametrize("window_bytes", [1, 20_000, 1 << 30])
def test_a_mapped_table_read_window_by_window_equals_a_take(
    tmp_path, monkeypatch, window_bytes, release
):
    """Chunks read through one view of the mapping, windows of any size (1 byte: a window a
    chunk; 1 GiB: the whole file in one), pieces in any order and across chunks' order."""
    monkeypatch.setattr(token_gather, "WINDOW_BYTES", window_bytes)
    lengths = np.random.default_rng(5).integers(1, 60, 3000)
    path, table, mapped = _mapped_table(tmp_path, lengths, 97)
    gather = TokenGather(mapped, ("input_ids", "labels"), (str(path),))
    windows = int(gather._windows.of_chunk.max()) + 1
    chunks = -(-len(lengths) // 97)
    assert windows == {1: chunks, 1 << 30: 1}.get(window_bytes, windows) and 1 <= windows <= chunks
    doc_starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    pick = np.random.default_rng(6).permutation(len(lengths))[:2000]
    starts = doc_starts[pick] + lengths[pick] // 3  # pieces from inside the dialogues
    sizes = lengths[pick] - lengths[pick] // 3
    got = gather.gather(starts, sizes)
    for k in ("input_ids", "labels"):
        joined = table.column(k).combine_chunks().flatten().to_numpy()
        np.testing.assert_array_equal(got[k], joined[token_indices(starts, sizes)])
    assert _resident_kib(path) * 1024 < path.stat().st_size / 10


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps is Linux's")
def test_reading_the_lengths_or_the_chunks_leaves_the_mapped_pages_released(tmp_path, release):
    """Reading every chunk's offsets maps their neighbours too (fault-around): lengths and a
    TokenGather built over a mapped table leave only a few pages of it resident."""
    lengths = np.random.default_rng(7).integers(100, 400, 8000)
    path, table, mapped = _mapped_table(tmp_path, lengths, 50)
    drop_mapped_pages([str(path)])
    got = list_lengths(mapped.column("input_ids"), (str(path),))
    np.testing.assert_array_equal(got, lengths)
    assert _resident_kib(path) * 1024 < path.stat().st_size / 10
    TokenGather(mapped, ("input_ids", "labels"), (str(path),))
    assert _resident_kib(path) * 1024 < path.stat().st_size / 10
    # In memory (no files named): the same lengths, nothing to release.
    np.testing.assert_array_equal(list_lengths(table.column("input_ids")), lengths)
