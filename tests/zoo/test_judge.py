"""The zoo's judge (``tools.zoo.judge``) says "leaked", "crashed" and "not exercised" when
it must: on a real capture of a packed row that leaks (the tiny InternLM2 unpatched, one
position range over two documents, as XTuner packs them), on logs that end in a traceback, and
on a batch whose packed row holds one document. The controls: the same capture computed with
each document alone is "trained isolated"; a clean log is not a crash.
"""

from pathlib import Path

import pytest
import stock_configs as sc
import torch
from mmengine.config import Config

from tools import zoo
from xtuner_rope.capture.text import compare_capture, reference_llm

RECIPE = sc.REPO / "configs" / "tiny_internlm2_short_dialogues.py"


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> Path:
    """The tiny recipe with its checkpoint's absolute path (compare_capture loads it)."""
    model = sc.ensure_tiny_model().resolve()
    text = RECIPE.read_text().replace('"models/tiny-internlm2"', f'"{model}"')
    path = tmp_path_factory.mktemp("judge") / "tiny.py"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def llm(config):
    return reference_llm(Config.fromfile(str(config)))


def capture(tmp_path: Path, llm, lengths: list[int], leak: bool) -> Path:
    """A capture file of one packed row of documents of ``lengths``: its logits from one
    forward over the whole row with positions 0..s-1 (``leak``: every document sees the ones
    before it), or each document's own forward (isolated)."""
    torch.manual_seed(0)
    s = sum(lengths)
    ids = torch.randint(3, 200, (1, s))  # [1, s]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    with torch.no_grad():
        if leak:
            logits = llm(input_ids=ids, position_ids=torch.arange(s)[None]).logits  # [1, s, V]
        else:
            logits = torch.cat(
                [
                    llm(input_ids=ids[:, a:e], position_ids=torch.arange(e - a)[None]).logits
                    for a, e in zip(cu[:-1].tolist(), cu[1:].tolist())
                ],
                dim=1,
            )  # [1, s, V]
    data = {
        "input_ids": ids,
        "labels": ids.clone(),
        "position_ids": torch.cat([torch.arange(n) for n in lengths])[None],
        "cumulative_len": [cu],
        "max_seqlen": max(lengths),
    }
    path = tmp_path / "capture.pt"
    torch.save({"data": data, "logits": logits.float(), "loss": 0.0, "dtype": "float32"}, path)
    return path


def test_a_leaky_capture_is_judged_leaked(tmp_path, config, llm):
    verdict = zoo.judge_capture(compare_capture(config, capture(tmp_path, llm, [9, 7], True)))
    assert verdict["outcome"] == zoo.LEAKED, verdict
    assert verdict["relative"] > 1e-3 and "max |trained - alone|" in verdict["message"]


def test_the_same_documents_alone_are_trained_isolated(tmp_path, config, llm):
    verdict = zoo.judge_capture(compare_capture(config, capture(tmp_path, llm, [9, 7], False)))
    assert verdict["outcome"] == zoo.TRAINED, verdict
    assert verdict["most_in_a_row"] == 2 and "(2 in one row)" in verdict["message"]


def test_a_packed_row_of_one_document_is_not_exercised(tmp_path, config, llm):
    """One document cannot leak into itself: isolation is not shown, whatever the numbers."""
    verdict = zoo.judge_capture(compare_capture(config, capture(tmp_path, llm, [16], True)))
    assert verdict["outcome"] == zoo.NOT_EXERCISED, verdict
    assert "no row held two documents" in verdict["message"]


TRACEBACK = (
    "11/25 02:00:00 - mmengine - INFO - Iter(train) [1/4] loss: 6.9\n"
    "Traceback (most recent call last):\n"
    '  File "xtuner/tools/train.py", line 360, in main\n'
    "    runner.train()\n"
    "RuntimeError: shape '[1, 512, 4, 16]' is invalid for input of size 100\n"
)


@pytest.mark.parametrize("code", [1, 0])
def test_a_log_with_a_traceback_is_judged_crashed(tmp_path, code):
    """Also with exit 0: a launcher that ignores its child's status (``xtuner train``)."""
    row = zoo.judge_run(code, TRACEBACK, tmp_path, tmp_path / "c.py", iters=4)
    assert row == {
        "outcome": zoo.CRASHED,
        "message": "RuntimeError: shape '[1, 512, 4, 16]' is invalid for input of size 100",
    }


def test_a_clean_log_is_not_a_crash(tmp_path):
    """The control: exit 0 without a traceback goes on to the run's log and capture (here
    absent: the run wrote no log, which is a crash of its own kind, named as such)."""
    row = zoo.judge_run(0, "Iter(train) [4/4] loss: 6.1\n", tmp_path, tmp_path / "c.py", 4)
    assert row["outcome"] == zoo.CRASHED and "Traceback" not in row["message"]
    assert "RuntimeError: shape" not in row["message"]


def test_the_doctor_is_not_scored_on_the_sweeps_own_errors():
    doctor = {"exit_code": 1, "reasons": ["OSError: Incorrect path_or_model_id: '/mnt/x'"]}
    harness = {"outcome": zoo.SWEEP_ERROR, "doctor": doctor, "message": "zoo: left ['/mnt/x']"}
    assert zoo.doctor_agrees(harness) is None
    assert zoo.counts({"a": harness})["doctor wrong"] == 0
    crashed = {**harness, "outcome": zoo.CRASHED, "message": "OSError: something else"}
    assert zoo.doctor_agrees(crashed) is False  # a real crash with another reason still counts
    idle = {"outcome": zoo.NOT_EXERCISED, "doctor": {"exit_code": 0, "reasons": []}}
    assert zoo.doctor_agrees(idle) is True  # it trained: exit 0 was right


def test_recorded_rows_are_rejudged_by_the_current_rule():
    """Rows recorded before the two-document rule (``python -m tools.zoo --rejudge``)."""
    one = {"outcome": zoo.TRAINED, "documents": 1, "message": "1 documents, max 1.8e-07"}
    assert zoo.rejudge(one)["outcome"] == zoo.NOT_EXERCISED
    assert "recorded: 1 documents" in zoo.rejudge(one)["message"]
    pairs = {"outcome": zoo.TRAINED, "documents": 2, "boundaries": "unpacked (one response a row)"}
    assert zoo.rejudge({**pairs, "message": "1 dpo pairs"})["outcome"] == zoo.NOT_EXERCISED
    packed = {"outcome": zoo.TRAINED, "documents": 12, "boundaries": "cumulative_len"}
    assert zoo.rejudge({**packed, "message": "12 documents"}) == {
        **packed,
        "message": "12 documents",
    }
    leaked = {"outcome": zoo.LEAKED, "documents": 1, "message": "x"}
    assert zoo.rejudge(leaked) is leaked


def test_a_crash_inside_the_sweeps_capture_hook_is_a_sweep_error(tmp_path):
    log = TRACEBACK.replace(
        "    runner.train()\n",
        '    runner.train()\n  File "/x/xtuner_rope/capture/llava.py", line 95, in before\n',
    )
    row = zoo.judge_run(1, log, tmp_path, tmp_path / "c.py", iters=4)
    assert row["outcome"] == zoo.SWEEP_ERROR and row["message"].startswith("capture hook: ")
