"""XTuner's cut of ``is_reference`` preference pairs (``tokenize_ref``) counted exactly.

80 pairs in the stock POLAR configs' format, the tiny tokenizer, three settings: prompts cut
from the front to fit (``max_length`` 256), and two where the responses leave some prompts no
room (XTuner's ``max_prompt_length`` 0: the whole prompt kept; below 0: only its first tokens
dropped). The references are live: XTuner's own ``PreferenceDataset`` (the plugin's wrapper
taken off) at the setting, with nothing cut (``max_length`` and ``max_response_length``
unlimited), and at the ``max_length`` the figures say keeps every pair whole (and one less);
XTuner's own log lines ("sequence length N is larger than max_response_length /
max_prompt_length B") give what each cut dropped. The doctor is checked on the stock
``POLAR_1_8B_full_varlenattn_custom_dataset`` with the one edit.
"""

import logging
import re

import preference_configs as pc
import pytest
import stock_configs as sc
from datasets import load_dataset
from logged import mmengine_records
from mmengine.logging import MMLogger
from tokenizers.processors import TemplateProcessing
from transformers import AutoTokenizer
from xtuner_unpatched import xtuner_unpatched

from xtuner_rope.doctor.diagnose import diagnose
from xtuner_rope.doctor.report import format_summary

REWARD_TOKEN = 3
# (max_length, max_response_length) -> XTuner's max_prompt_length where it cuts: every one
# above 0; some 0 (the whole prompt kept); some below 0 (only its first tokens dropped)
SETTINGS = {(256, 64): "above 0", (128, 62): "0", (128, 64): "below 0"}
UNLIMITED = 10**9


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    sc.ensure_tiny_model()
    path = pc.write_reference_pairs(tmp_path_factory.mktemp("reference") / "pairs.jsonl")
    tokenizer = AutoTokenizer.from_pretrained(str(sc.TINY_MODEL))
    # a BOS before every text, as InternLM2's (POLAR's) tokenizer adds: a special token that
    # tokenize_ref's cut drops from the prompt and its decode skips anyway
    bos = tokenizer.bos_token
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, tokenizer.bos_token_id)]
    )
    return path, load_dataset("json", data_files=str(path), split="train"), tokenizer


def _build(data, tokenizer, max_length, max_response_length, unpatched=True, log=None):
    """XTuner's ``PreferenceDataset`` of the pairs (its own unless ``unpatched`` is False);
    XTuner's log lines (written by its tokenizing worker processes) into ``log``."""
    import xtuner.dataset.preference_dataset as preference

    handler = logging.FileHandler(log) if log else None
    logger = MMLogger.get_current_instance()
    if handler:
        logger.addHandler(handler)
    try:
        with xtuner_unpatched() if unpatched else _nothing():
            return preference.PreferenceDataset(
                data,
                tokenizer,
                max_length,
                is_dpo=False,
                is_reward=True,
                reward_token_id=REWARD_TOKEN,
                num_proc=1,
                max_response_length=max_response_length,
                is_reference=True,
            )
    finally:
        if handler:
            logger.removeHandler(handler)
            handler.close()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _cuts(log):
    """XTuner's own log lines: ``[(length, max_response_length)]``, ``[(length, budget)]``."""
    text = log.read_text()
    found = re.findall(r"sequence length (\d+) is larger than (max_\w+_length) (-?\d+)", text)
    response = [(int(n), int(b)) for n, what, b in found if what == "max_response_length"]
    prompt = [(int(n), int(b)) for n, what, b in found if what == "max_prompt_length"]
    return response, prompt


def _dropped(n: int, budget: int) -> int:
    """Prompt tokens ``prompt[-budget:]`` drops from a prompt of ``n`` (XTuner's slice)."""
    return n - len(range(n)[-budget:])


@pytest.mark.parametrize("max_length,max_response_length", list(SETTINGS))
def test_the_counted_pairs_are_xtuners_and_the_figures_what_tokenize_ref_loses(
    pairs, tmp_path, max_length, max_response_length
):
    _, data, tokenizer = pairs
    # each prompt starts with the BOS, its only special token: what a cut drops besides text
    special = set(tokenizer.all_special_ids)
    prompts = ["\n".join(m["content"] for m in p) for p in data["prompt"]]
    for ids in tokenizer(prompts).input_ids:
        assert ids[0] == tokenizer.bos_token_id and not special & set(ids[1:])
    log = tmp_path / "xtuner.log"
    xtuner = _build(data, tokenizer, max_length, max_response_length, log=log)
    counted = _build(data, tokenizer, max_length, max_response_length, unpatched=False)
    assert [dict(p) for p in counted] == [dict(p) for p in xtuner]  # pair for pair
    figures, ref = counted.truncation, counted.truncation["reference"]
    whole = _build(data, tokenizer, UNLIMITED, UNLIMITED)
    differ = [i for i in range(len(data)) if dict(xtuner[i]) != dict(whole[i])]
    assert figures["truncated"] == len(differ) > 0 and figures["unit"] == "pair"
    assert figures["first_truncated"] == differ[:10]
    response, prompt = _cuts(log)
    assert figures["responses"] == len(response) > 0
    assert ref["response_tokens"]["lost"] == sum(n - cut for n, cut in response)
    text_lost = [_dropped(n, b) - 1 for n, b in prompt if _dropped(n, b)]  # less the BOS
    assert ref["prompt_tokens"]["lost"] == sum(text_lost)
    assert ref["prompts"] == sum(lost > 0 for lost in text_lost)
    assert ref["no_room"] == sum(b <= 0 for _, b in prompt)
    budgets = {b for _, b in prompt}
    edge = SETTINGS[(max_length, max_response_length)]
    assert {"above 0": min(budgets) > 0, "0": 0 in budgets, "below 0": min(budgets) < 0}[edge]
    lost = ref["prompt_tokens"]["lost"] + ref["response_tokens"]["lost"]
    assert figures["tokens"]["lost"] == lost and figures["labels"]["lost"] == 0
    final = [len(p[f"{r}_ids"]) for p in xtuner for r in ("chosen", "rejected")]
    assert ref["over_max_length"] == sum(n > max_length for n in final)
    assert ref["longest"] == max(final) and ref["sequences"] == 2 * len(data)
    # the max_length the figures name keeps every pair whole; one less does not
    keep, response_length = figures["keep_all"], ref["keep_response_length"]
    assert [dict(p) for p in _build(data, tokenizer, keep, response_length)] == [
        dict(p) for p in whole
    ]
    assert [dict(p) for p in _build(data, tokenizer, keep - 1, response_length)] != [
        dict(p) for p in whole
    ]


def test_the_start_up_line_counts_and_warns_on_prompts_left_no_room(pairs):
    _, data, tokenizer = pairs
    with mmengine_records() as records:
        counted = _build(data, tokenizer, 128, 64, unpatched=False)
    lines = [(r.levelno, r.getMessage()) for r in records]
    figures, ref = counted.truncation, counted.truncation["reference"]
    (line,) = [x for x in lines if "build_preference_dataset tokenized" in x[1]]
    assert line[0] == logging.WARNING
    assert (
        f"XTuner's preference tokenize_ref cuts {figures['truncated']} of {len(data)} pairs at "
        f"max_length=128, max_response_length=64: {figures['responses']} responses"
    ) in line[1]
    assert (
        f"{ref['no_room']} of {len(data)} pairs leave the prompt no room" in line[1]
        and ref["no_room"] > 0
    )
    assert "-> set max_response_length = 61 or less" in line[1]  # (128 - 6) // 2
    assert f"or max_length = {ref['fit_all']} (every prompt whole)" in line[1]
    assert (
        f"{ref['over_max_length']} of {2 * len(data)} sequences (reference + response, each "
        "with the prompt, re-encoded) are longer than max_length=128"
    ) in line[1]


def test_the_doctor_counts_reference_pairs_and_warns_on_the_edge(pairs, tmp_path):
    path, _, _ = pairs
    text = pc.localize_preference(
        sc.copy_stock(pc.POLAR, tmp_path),
        pc.POLAR,
        path,
        max_length=128,
        reward_token_id=REWARD_TOKEN,
        max_response_length=64,
    )
    # the stock 3% warm-up rounds to 0 iterations on 80 pairs (the doctor names it)
    text = sc.sub_once(text, r"^warmup_ratio = 0.03$", "warmup_ratio = 0.1")
    config = tmp_path / "polar.py"
    config.write_text(sc.enable_plugin(text))
    report, _ = diagnose(str(config), progress=False, batches=2)
    figures = report["truncation"]
    assert figures["reference"]["no_room"] > 0 and figures["truncated"] > 0
    assert report["preference"]["truncated_responses"] == figures["responses"]
    summary = format_summary(report)
    assert (
        f"truncation   {figures['truncated']} of {figures['dialogues']} pairs truncated at "
        "max_length=128 by XTuner's preference tokenize_ref ("
        f"{figures['responses']} responses cut at max_response_length=64"
    ) in summary
    assert summary.splitlines()[-1].startswith(
        f"TRUNCATED: {figures['truncated']} of {figures['dialogues']} pairs lose tokens at "
        "max_length=128, max_response_length=64"
    ), report["problems"]
    (cut,) = [w for w in report["warnings"] if "tokenize_ref cuts" in w]
    assert (
        f"-> set max_length = {figures['keep_all']} (every pair whole) or "
        f"{figures['keep_99']} (99%) with max_response_length = "
        f"{figures['reference']['keep_response_length']}"
    ) in cut
    (room,) = [w for w in report["warnings"] if "leave the prompt no room" in w]
    assert "-> set max_response_length = 61 or less" in room
