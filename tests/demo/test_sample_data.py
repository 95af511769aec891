"""The sample dialogues: the generator (``tools/sample_data/``) and the file the package ships
(``xtuner_rope/demo/short_dialogues.jsonl``, read by ``xtuner_rope.demo.sample_dialogues``;
``data/short_dialogues.jsonl`` links to it)."""

import collections
import json
import re
from pathlib import Path

import pytest

from tools.sample_data import dialogue_words, generate_dialogues, to_jsonl, write_jsonl
from xtuner_rope.demo.sample_dialogues import sample_dialogues, sample_path

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "data" / "short_dialogues.jsonl"


@pytest.fixture(scope="module")
def committed_text():
    return DATA.read_bytes().decode("utf-8")


@pytest.fixture(scope="module")
def dialogues(committed_text):
    return [json.loads(line) for line in committed_text.splitlines()]


def _contents(dialogues, role):
    return [m["content"] for d in dialogues for m in d["messages"] if m["role"] == role]


def test_committed_file_regenerates_byte_for_byte(committed_text):
    n = committed_text.count("\n")
    assert to_jsonl(generate_dialogues(n=n, seed=0)) == committed_text, (
        "xtuner_rope/demo/short_dialogues.jsonl is stale: run `python tools/make_sample_data.py "
        "--out xtuner_rope/demo/short_dialogues.jsonl --n 2400 --seed 0`"
    )


def test_the_repository_data_is_the_file_the_package_ships():
    """One copy: ``data/`` links to the package's file, which the package reads at run time."""
    assert DATA.is_symlink() and DATA.resolve() == sample_path().resolve()
    assert sample_path().parent == REPO / "xtuner_rope" / "demo"


def test_the_package_reads_the_shipped_dialogues(dialogues):
    assert sample_dialogues() == dialogues
    assert sample_dialogues(3) == dialogues[:3]
    with pytest.raises(ValueError, match=r"n=2401, but the shipped sample holds 2400 dialogues"):
        sample_dialogues(2401)


def test_committed_file_is_small_and_newline_terminated(committed_text):
    assert DATA.stat().st_size < 2 * 1024 * 1024
    assert committed_text.endswith("\n") and "\r" not in committed_text


def test_write_jsonl_round_trips(tmp_path):
    dialogues = generate_dialogues(n=50, seed=3)
    path = tmp_path / "d.jsonl"
    write_jsonl(dialogues, path)
    assert path.read_bytes() == to_jsonl(dialogues).encode("utf-8")
    assert [json.loads(line) for line in path.read_text().splitlines()] == dialogues


def test_same_seed_same_data_other_seed_other_data():
    assert generate_dialogues(n=200, seed=1) == generate_dialogues(n=200, seed=1)
    assert generate_dialogues(n=200, seed=1) != generate_dialogues(n=200, seed=2)


def test_record_format(dialogues):
    for i, d in enumerate(dialogues):
        assert list(d) == ["messages"], i
        msgs = d["messages"]
        for m in msgs:
            assert list(m) == ["role", "content"] and isinstance(m["content"], str), (i, m)
        if msgs[0]["role"] == "system":
            msgs = msgs[1:]
        roles = [m["role"] for m in msgs]
        # No second system message, strict user/assistant alternation, assistant last.
        assert roles == ["user", "assistant"] * (len(roles) // 2) and roles, (i, roles)
        assert all(m["content"] for m in msgs), i  # only the system prompt may be empty


def test_ascii_and_english_only(committed_text):
    assert committed_text.isascii()


def test_shapes_of_real_data(dialogues):
    assert len(dialogues) >= 2000
    turns = collections.Counter(sum(m["role"] == "user" for m in d["messages"]) for d in dialogues)
    assert turns[1] > len(dialogues) / 2, "single-turn dialogues should be the majority"
    assert set(turns) == {1, 2, 3, 4}

    words = [dialogue_words(d) for d in dialogues]
    assert max(words) <= 100 and 40 <= sum(words) / len(words) <= 60

    systems = [d["messages"][0] for d in dialogues if d["messages"][0]["role"] == "system"]
    assert 0 < len(systems) < len(dialogues), "system prompt: present in some, absent in others"
    assert sum(s["content"] == "" for s in systems) >= 100, "some system prompts should be empty"

    replies = _contents(dialogues, "assistant")
    assert sum(len(r.split()) == 1 for r in replies) >= 200, "need one-word replies"
    users = collections.Counter(_contents(dialogues, "user"))
    assert users["hi"] + users["Hello!"] + users["Hi there"] >= 100, "greetings should repeat"
    assert sum(len(u.split()) == 1 for u in users.elements()) >= 200, "need one-word user turns"
    assert len(users) >= 1500, "user messages should be varied"


# Computed answers must be true: check every "a op b = c" the generator wrote.
_EQUATION = re.compile(r"(-?\d+) ([-+x/]) (\d+) = (-?\d+)")
_CELSIUS = re.compile(r"(-?\d+) x 9/5 = (-?\d+), plus 32 is (-?\d+)")
_OPS = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "x": lambda a, b: a * b,
    "/": lambda a, b: a / b,
}


def test_equations_are_correct(dialogues):
    found = 0
    for reply in _contents(dialogues, "assistant"):
        for a, op, b, c in _EQUATION.findall(reply):
            assert _OPS[op](int(a), int(b)) == int(c), reply
            found += 1
        for c, scaled, f in _CELSIUS.findall(reply):
            assert int(c) * 9 / 5 == int(scaled) and int(scaled) + 32 == int(f), reply
            found += 1
    assert found >= 300


def test_short_arithmetic_answers_are_correct(dialogues):
    checked = 0
    for d in dialogues:
        msgs = [m for m in d["messages"] if m["role"] != "system"]
        for user, reply in zip(msgs[::2], msgs[1::2]):
            m = re.search(r"(\d+) ?(plus|minus|times|divided by|[-+*/]) ?(\d+)", user["content"])
            if m and re.fullmatch(r"-?\d+\.", reply["content"]) and "box" not in user["content"]:
                a, op, b = int(m[1]), m[2], int(m[3])
                expected = {
                    "plus": a + b,
                    "+": a + b,
                    "minus": a - b,
                    "-": a - b,
                    "times": a * b,
                    "*": a * b,
                    "divided by": a // b,
                    "/": a // b,
                }[op]
                assert int(reply["content"][:-1]) == expected, (user, reply)
                checked += 1
    assert checked >= 20


def test_letter_counts_are_correct(dialogues):
    checked = 0
    for reply in _contents(dialogues, "assistant"):
        m = re.search(r"'(\w+)' is (?:spelled )?([a-z-]+)[.,]", reply)
        if m and "-" in m[2]:
            word = m[1]
            assert m[2] == "-".join(word), reply
            if n := re.search(r"has (\d+) letters", reply):
                assert int(n[1]) == len(word), reply
            if n := re.search(r"letter '(\w)' appears (once|\d+ times)", reply):
                count = 1 if n[2] == "once" else int(n[2].split()[0])
                assert word.count(n[1]) == count, reply
            checked += 1
    assert checked >= 50
