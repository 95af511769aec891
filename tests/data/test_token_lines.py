"""The bulk parse of XTuner's tokenized ``.bin`` lines against ``json.loads`` and XTuner's own
reader (``JsonlDataset``): every row of ``build_whole_packed_dataset`` equal, token for token
and type for type, to the row read document by document through XTuner's reader."""

import json
import pickle

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from xtuner.dataset import intern_repo

from xtuner_rope.data.intern_repo_packing import build_whole_packed_dataset
from xtuner_rope.data.token_lines import TokenLines, parse_token_lines


def _json_tokens(line: bytes):
    """``json.loads(line)["tokens"]`` as XTuner's reader reads it, or None where that is not a
    list of integers whose absolute values fit int64 (what the bulk parse must refuse)."""
    try:
        values = json.loads(line)["tokens"]
    except (ValueError, TypeError, KeyError):
        return None
    if not isinstance(values, list):
        return None
    fits = all(type(v) is int and -(2**63) < v < 2**63 for v in values)
    return values if fits else None


def _line(body: bytes) -> bytes:
    return b'{"tokens": [' + body + b"]}"


@given(
    st.lists(st.text("0123456789-, .e+\t[", max_size=12).map(str.encode), min_size=1, max_size=4)
)
@example([b"1, -2, 3", b"0", b"-0", b" 7 ,8 ", b""])
@example([b"123456789012345678", b"-999999999999999999", b"-9223372036854775807"])
@example([b"-9223372036854775808", b"9223372036854775808"])
def test_bulk_parse_is_json_or_refuses(bodies):
    """Any bytes: the parse either returns exactly ``json.loads``'s integers, or None."""
    lines = [_line(b) for b in bodies]
    got = parse_token_lines(lines)
    want = [_json_tokens(line) for line in lines]
    if got is not None:
        values, counts = got
        assert None not in want
        assert values.tolist() == [v for w in want for v in w]
        assert counts.tolist() == [len(w) for w in want]


@given(st.lists(st.lists(st.integers(-(2**63) + 1, 2**63 - 1), min_size=1), min_size=1))
def test_every_json_dumps_list_of_int64_is_taken(lists):
    """What ``json.dumps`` writes (either separator style) never goes the slow way."""
    for sep in (", ", ","):
        lines = [json.dumps({"tokens": v}, separators=(sep, ":")).encode() for v in lists]
        values, counts = parse_token_lines(lines)
        assert values.tolist() == [v for w in lists for v in w]
        assert counts.tolist() == [len(w) for w in lists]


@pytest.mark.parametrize(
    "body",
    [b"1 2", b"01", b"-01", b"1.0", b"1e3", b"--1", b"- 1", b"1-", b"+1", b"1,,2", b"1,",
     b"1\n", b"12345678901234567890", b"-9223372036854775808", b"true", b"null", b"[1]",
     b'"1"', b"0x1", b"NaN"],
)  # fmt: skip
def test_bodies_outside_int64_lists_are_refused(body):
    assert parse_token_lines([_line(b"5"), _line(body)]) is None


@pytest.mark.parametrize(
    "line",
    [b'{"tokens": [1], "tokens": [2]}', b'{"tokens": null}', b"{}", b"[1]", b"",
     b'{"tokens": [1]} {"tokens": [2]}', b'{"tokens": [1]}x', b'{"Tokens": [1]}',
     b'{"tokens": "12"}'],
)  # fmt: skip
def test_lines_that_are_not_one_tokens_object_are_refused(line):
    assert parse_token_lines([_line(b"5"), line]) is None


def _write_bin(path, documents: list[list[int]], odd: dict[int, str]) -> None:
    """One line a document, as XTuner's loader reads them; ``odd[i]``: line ``i`` in another
    JSON form: compact or spaces inside the list (parsed in bulk), an extra key, a CRLF end,
    spaces around the key, floats (left to XTuner's reader)."""
    meta, at = [], 0
    with open(path, "wb") as out:
        for i, tokens in enumerate(documents):
            line = {
                None: json.dumps({"tokens": tokens}),
                "compact": json.dumps({"tokens": tokens}, separators=(",", ":")),
                "key": json.dumps({"tokens": tokens, "source": "web"}),
                "crlf": json.dumps({"tokens": tokens}) + "\r",
                "spaces": json.dumps({"tokens": tokens}).replace('{"tokens":', '{ "tokens" :'),
                "inner": json.dumps({"tokens": tokens}).replace("[", "[ ").replace("]", " ]"),
                "float": json.dumps({"tokens": tokens}).replace("]", ".0]"),
            }[odd.get(i)]
            data = (line + "\n").encode()
            meta.append((at, len(tokens)))
            out.write(data)
            at += len(data)
    with open(f"{path}.meta", "wb") as f:
        np.save(f, np.array(meta, dtype=np.int64))


def _documents(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    docs = []
    for size in rng.integers(1, 40, n):
        tokens = rng.integers(-500, 500, size)  # negative: unsupervised; 0 too
        docs.append(tokens.tolist())
    docs[3] = [0, 0, 1]
    docs[5] = rng.integers(-(10**17), 10**17, 150).tolist()  # longer than a row: pieces
    return docs


def _reference_row(packer, row: int) -> dict:
    """The row read document by document through XTuner's ``JsonlDataset.__getitem__``."""
    ids, labels, bounds = [], [], [0]
    pieces = range(packer.row_pieces[row], packer.row_pieces[row + 1])
    for doc, a, n in zip(packer.documents[pieces], packer.offsets[pieces], packer.sizes[pieces]):
        sample = packer.dataset[int(doc)]
        ids += sample["input_ids"][a : a + n]
        labels += sample["labels"][a : a + n]
        bounds.append(bounds[-1] + int(n))
    positions = [p for a, b in zip(bounds[:-1], bounds[1:]) for p in range(b - a)]
    return {"input_ids": ids, "cumulative_len": bounds, "position_ids": positions, "labels": labels}


@pytest.mark.parametrize(
    "odd", [{}, {7: "compact", 8: "inner"}, {2: "key", 9: "crlf", 11: "spaces"}]
)
def test_every_row_equals_xtuners_reader(tmp_path, odd):
    docs = _documents(120, len(odd))
    _write_bin(tmp_path / "docs.bin", docs, odd)
    cfg = dict(type=intern_repo.load_intern_repo_tokenized_dataset, folder=str(tmp_path))
    (packer,) = build_whole_packed_dataset(cfg, packed_length=64, seed=3).datasets
    for row in range(len(packer)):
        got, want = packer[row], _reference_row(packer, row)
        assert got == want
        assert all(type(v) is int for k in got for v in got[k])
    assert packer._lines is not None and packer._lines is not False  # the bulk reader ran
    copy = pickle.loads(pickle.dumps(packer))  # XTuner's broadcast: the file's mapping stays out
    assert copy._lines is None and copy[0] == packer[0]


def test_the_bulk_parse_takes_json_lines_of_integers_and_leaves_the_others(tmp_path):
    docs = _documents(20, 0)
    odd = {6: "float"}  # json.loads reads floats: XTuner's reader keeps them
    taken = {1: "key", 2: "crlf", 4: "spaces", 7: "compact", 8: "inner"}
    _write_bin(tmp_path / "docs.bin", docs, {**odd, **taken})
    (source,) = intern_repo.load_intern_repo_tokenized_dataset(str(tmp_path))
    lines = TokenLines(source.path, source.offsets, source.length)
    for doc in range(20):
        got = lines.pieces(np.array([doc]), np.array([1]), np.array([len(docs[doc]) - 1]))
        if doc in odd:
            assert got is None
        else:
            want = source[doc]
            assert got[0].tolist() == want["input_ids"][1:]
            assert got[1].tolist() == want["labels"][1:]
    wrong_meta = TokenLines(source.path, source.offsets, source.length + 1)
    assert wrong_meta.pieces(np.array([0]), np.array([0]), np.array([1])) is None
    lines.close()
    wrong_meta.close()
