"""Catalogue of bad preference inputs (DPO, ORPO, reward model): named before the first step.

The pairs are made by XTuner's own code: ``orpo_dpo_mix_40k_map_fn`` and ``tokenize``
(``xtuner.dataset.preference_dataset``) with the tiny InternLM2 tokenizer, packed by XTuner's
``PackedDatasetWrapper``. ``PackedBatchCheckHook.before_train`` runs
``check_preference_dataset`` on the run's train dataset; a dataset map function that fails
names its source row (``xtuner_preference.patch_preference_map_fn_errors``); a reward token outside the
vocabulary (or left at -1) is a start-up conflict (``config.preference``).
"""

import re

import pytest
from datasets import Dataset
from mmengine.config import Config
from stock_configs import ensure_tiny_model
from transformers import AutoTokenizer
from xtuner.dataset import preference_dataset as xtuner_preference

from xtuner_rope.config.preference import preference_findings
from xtuner_rope.data.preference_checks import check_preference_dataset, preference_pair_problems

U = {"role": "user", "content": "What is 7 plus 5?"}


def answer(text: str) -> dict:
    return {"role": "assistant", "content": text}


def row(chosen="Twelve.", rejected="Eleven.") -> dict:
    return {"chosen": [U, answer(chosen)], "rejected": [U, answer(rejected)]}


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(ensure_tiny_model()), trust_remote_code=True)


def pair(tokenizer, source: dict, max_length: int = 64, reward: bool = False) -> dict:
    """One pair as ``build_preference_dataset`` makes it (XTuner's map and tokenize)."""
    mapped = xtuner_preference.orpo_dpo_mix_40k_map_fn(source)
    return xtuner_preference.tokenize(
        mapped, tokenizer, max_length, is_reward=reward, reward_token_id=3 if reward else -1
    )


def problems(pairs, **kw) -> str:
    return "\n".join(preference_pair_problems(pairs, **kw))


BAD = {
    "chosen equal to rejected": (
        lambda t: problems([pair(t, row()), pair(t, row("Twelve.", "Twelve."))]),
        r"1 pairs whose chosen and rejected are the same tokens \(first: 1\).*train nothing.*"
        r"Remove them from the data or give them a real rejected answer",
    ),
    "response cut away by max_length (the prompt fills it)": (
        lambda t: problems([pair(t, row(), max_length=8)]),
        r"responses with no supervised token \(first: 0 \(chosen\), 0 \(rejected\)\).*Raise "
        r"max_length or shorten the prompts",
    ),
    "labels not as long as the ids (a response turn missing)": (
        lambda t: problems(
            [{**pair(t, row()), "chosen_labels": pair(t, row())["chosen_labels"][:-2]}]
        ),
        r"responses whose labels are not as long as their ids \(first: 0 \(chosen: \d+ labels, "
        r"\d+ ids\)\).*Give every chosen and rejected conversation its assistant answer",
    ),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_pairs_are_named_with_their_fix(case, tokenizer):
    call, match = BAD[case]
    text = call(tokenizer)
    assert re.search(match, text, re.S), text


def test_pair_longer_than_max_packed_length_is_named_not_dropped(tokenizer):
    """XTuner's wrapper drops the pair and logs a count; the check names it (source index)."""
    pairs = [pair(tokenizer, row()), pair(tokenizer, row("Twelve, since seven plus five " * 4))]
    long = len(pairs[1]["chosen_ids"]) + len(pairs[1]["rejected_ids"])
    wrapped = xtuner_preference.PackedDatasetWrapper(pairs, max_packed_length=long - 1)
    assert len(wrapped.data) == 1 and len(wrapped.data[0]) == 1  # XTuner kept pair 0 only
    with pytest.raises(
        ValueError,
        match=rf"(?s)\(2 pairs, numbered in dataset order\).*max_packed_length={long - 1}: 1 "
        rf"pairs are longer \(chosen \+ rejected; first: 1 \({long} tokens\)\) and "
        rf"PackedDatasetWrapper drops them.*Set max_packed_length >= {long}",
    ):
        check_preference_dataset(wrapped)
    check_preference_dataset(xtuner_preference.PackedDatasetWrapper(pairs, long))  # all kept


def test_empty_answer_trains_the_closing_tokens_as_given(tokenizer):
    """An empty assistant answer is data, not an error: its supervised tokens are the chat
    template's closing ones (the model learns to stop at once), labels aligned with ids."""
    p = pair(tokenizer, row(chosen=""))
    supervised = [t for t in p["chosen_labels"] if t != -100]
    assert supervised and len(p["chosen_labels"]) == len(p["chosen_ids"])
    assert p["chosen_ids"][-len(supervised) :] == supervised
    assert problems([p]) == ""


@pytest.mark.parametrize(
    "source, error",
    [
        ({"chosen": [U, answer("Twelve.")], "rejected": [U]}, "AssertionError"),  # one-sided
        ({"chosen": [U, answer("Twelve.")]}, "KeyError"),  # no rejected at all
    ],
    ids=["one-sided pair", "rejected missing"],
)
def test_one_sided_rows_name_the_source_row(source, error):
    rows = Dataset.from_list([row(), row(), source] if "rejected" in source else [source])
    index = 2 if "rejected" in source else 0
    with pytest.raises(
        ValueError,
        match=rf"source row {index}: dataset_map_fn orpo_dpo_mix_40k_map_fn failed \({error}.*"
        r"Fix or remove the row",
    ):
        xtuner_preference.map_dataset(rows, xtuner_preference.orpo_dpo_mix_40k_map_fn, 1)


@pytest.mark.parametrize("token, text", [(-1, "-1 is outside"), (5000, "5000 is outside")])
def test_reward_token_missing_or_out_of_vocabulary_is_a_start_up_conflict(token, text):
    cfg = Config(
        dict(
            model=dict(
                type="RewardModel",
                llm=dict(pretrained_model_name_or_path=str(ensure_tiny_model())),
            ),
            train_dataloader=dict(
                dataset=dict(type="build_preference_dataset", is_reward=True, reward_token_id=token)
            ),
        )
    )
    (finding,) = [f for f in preference_findings(cfg) if "reward_token_id" in f.setting]
    assert finding.fix is None and finding.problem.startswith(f"{text} the vocabulary")
    assert "set reward_token_id to an id in 0..1023" in finding.edit
