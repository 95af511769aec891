"""The preference-pair generator (``tools/sample_data/preference_pairs.py``) and the committed
``data/preference_pairs.jsonl``."""

import json
from pathlib import Path

import pytest

from tools.sample_data.preference_pairs import preference_pairs, write_pairs

REPO = Path(__file__).resolve().parents[2]
PAIRS = REPO / "data" / "preference_pairs.jsonl"
DIALOGUES = REPO / "data" / "short_dialogues.jsonl"


@pytest.fixture(scope="module")
def dialogues():
    return [json.loads(line) for line in DIALOGUES.read_text(encoding="utf-8").splitlines()]


def test_committed_pairs_regenerate_byte_for_byte(dialogues, tmp_path):
    committed = PAIRS.read_bytes()
    out = tmp_path / "pairs.jsonl"
    write_pairs(preference_pairs(dialogues, committed.count(b"\n")), str(out))
    assert out.read_bytes() == committed, (
        "data/preference_pairs.jsonl is stale: run `python tools/make_preference_data.py`"
    )
    assert len(committed) < 200_000 and b"\r" not in committed


def test_pairs_share_the_prompt_and_differ_in_the_answer():
    """The format of XTuner's orpo_dpo_mix_40k_map_fn, as the stock DPO/reward configs read it."""
    from xtuner.dataset.preference_dataset import orpo_dpo_mix_40k_map_fn

    rows = [json.loads(line) for line in PAIRS.read_text(encoding="utf-8").splitlines()]
    assert len(rows) == 300
    for row in rows:
        chosen, rejected = row["chosen"], row["rejected"]
        assert chosen[:-1] == rejected[:-1] and chosen[-2]["role"] == "user"
        assert chosen[-1]["role"] == rejected[-1]["role"] == "assistant"
        assert chosen[-1]["content"] != rejected[-1]["content"]
    mapped = orpo_dpo_mix_40k_map_fn(rows[0])
    assert mapped["chosen"] == rows[0]["chosen"][-1:]
    assert mapped["rejected"] == rows[0]["rejected"][-1:]


def test_too_few_dialogues_is_refused(dialogues):
    with pytest.raises(
        ValueError,
        match=r"preference_pairs: 5 pairs need 6 dialogues, got 5; "
        r"pass fewer pairs or more dialogues",
    ):
        preference_pairs(dialogues[:5], 5)
    same = [
        {
            "messages": [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"},
            ]
        }
    ] * 3
    with pytest.raises(
        ValueError,
        match=r"preference_pairs: no reply after dialogue 0 differs "
        r"from its own \('Hello!'\); pass more dialogues",
    ):
        preference_pairs(same, 2)
