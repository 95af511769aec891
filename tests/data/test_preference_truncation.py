"""XTuner's cut of preference responses at ``max_length`` counted exactly, in pairs.

Stock ``internlm2_chat_1_8b_dpo_full_varlenattn`` and the ultrafeedback reward config with the
one edit, ``max_length`` below some responses. The references are live: XTuner's own
``PreferenceDataset`` (the plugin's wrapper taken off) at that ``max_length`` (what training
gets) and at an unlimited one (every response whole); the counted pairs must be XTuner's, pair
for pair, and the figures the difference of the two.
"""

import logging

import preference_configs as pc
import pytest
import stock_configs as sc
from logged import mmengine_records
from mmengine.config import Config
from xtuner.registry import BUILDER
from xtuner_unpatched import xtuner_unpatched

from xtuner_rope.doctor.diagnose import diagnose
from xtuner_rope.doctor.report import format_summary

MAX_LENGTH = 100  # above every prompt (at most 73 tokens), below ~30% of the responses
RESPONSES = ("chosen", "rejected")


def _config(tmp, name, data, **kwargs):
    text = pc.localize_preference(
        sc.copy_stock(name, tmp), name, data, max_length=MAX_LENGTH, **kwargs
    )
    path = tmp / f"{name}.py"
    path.write_text(sc.enable_plugin(text))
    return path


def _pairs(path, max_length, unpatched):
    """The config's pairs before packing, as built at ``max_length``."""
    cfg = Config.fromfile(str(path))
    cfg.train_dataloader.dataset.update(max_length=max_length, use_varlen_attn=False)
    if not unpatched:
        return BUILDER.build(cfg.train_dataloader.dataset)
    with xtuner_unpatched():
        return BUILDER.build(cfg.train_dataloader.dataset)


@pytest.fixture(scope="module", params=[pc.DPO, pc.REWARD])
def preference(request, tmp_path_factory):
    sc.ensure_tiny_model()
    tmp = tmp_path_factory.mktemp("preference")
    data = pc.write_preference_pairs(tmp / "pairs.jsonl", n=120)
    reward = {"reward_token_id": 3} if request.param == pc.REWARD else {}
    path = _config(tmp, request.param, data, **reward)
    return path, _pairs(path, MAX_LENGTH, True), _pairs(path, 10**9, True), bool(reward)


def _count(pairs, key):
    return sum(
        (len(p[f"{r}_ids"]) if key == "tokens" else sum(x != -100 for x in p[f"{r}_labels"]))
        for p in pairs
        for r in RESPONSES
    )


def test_the_counted_pairs_are_xtuners_and_the_figures_what_its_cut_loses(preference):
    path, xtuner, whole, reward = preference
    with mmengine_records() as records:
        counted = _pairs(path, MAX_LENGTH, False)
    lines = [(r.levelno, r.getMessage()) for r in records]
    assert [dict(p) for p in counted] == [dict(p) for p in xtuner]  # pair for pair
    figures = counted.truncation
    extra = 1 if reward else 0  # the reward token, after the cut
    longest = [max(len(p[f"{r}_ids"]) - extra for r in RESPONSES) for p in whole]
    assert figures["dialogues"] == len(whole) and figures["unit"] == "pair"
    assert figures["truncated"] == sum(n > MAX_LENGTH for n in longest) > 0
    assert figures["responses"] == sum(
        len(p[f"{r}_ids"]) - extra > MAX_LENGTH for p in whole for r in RESPONSES
    )
    lost = _count(whole, "tokens") - _count(xtuner, "tokens")
    assert figures["tokens"] == {
        "before": _count(whole, "tokens"),
        "after": _count(xtuner, "tokens"),
        "lost": lost,
    }
    assert lost > 0
    labels = _count(whole, "labels") - _count(xtuner, "labels")
    assert (
        figures["labels"]["lost"] == labels and (labels > 0) != reward
    )  # reward: 1 label a response
    assert figures["keep_all"] == max(longest)
    (line,) = [x for x in lines if "build_preference_dataset tokenized" in x[1]]
    assert line[0] == logging.WARNING
    assert (
        f"XTuner's preference tokenize truncates {figures['truncated']} of {len(whole)} pairs "
        f"at max_length={MAX_LENGTH}"
    ) in line[1]
    assert f"max_length = {max(longest)} keeps every pair whole" in line[1]


def test_the_doctor_counts_pairs_and_ends_truncated(preference):
    path, _, _, reward = preference
    report, _ = diagnose(str(path), progress=False, batches=2)
    figures = report["truncation"]
    assert figures and figures["unit"] == "pair" and figures["truncated"] > 0
    assert report["preference"]["truncated_responses"] == figures["responses"]
    summary = format_summary(report)
    assert "dialogues" not in summary.split("collate")[0]  # the words follow the data
    t = figures["tokens"]
    assert f"tokens {t['before']} -> {t['after']} (lost {t['lost']})" in summary
    # a reward model's labels are its reward tokens, kept after the cut: lost 0 is the fact
    assert ("lost 0" in summary) == reward
    assert (
        f"truncation   {figures['truncated']} of {figures['dialogues']} pairs truncated" in summary
    )
    assert summary.splitlines()[-1].startswith(
        f"TRUNCATED: {figures['truncated']} of {figures['dialogues']} pairs lose their ends"
    ), report["problems"]
    (warning,) = [w for w in report["warnings"] if "preference tokenize truncates" in w]
    assert f"-> set max_length = {figures['keep_all']} (every pair whole)" in warning
