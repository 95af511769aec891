"""``xtuner-rope doctor`` and ``check`` on XTuner's stock InternVL configs (tiny checkpoints).

Both stock configs (``internvl_configs``: copied, localized, the one edit) exit 0 on both tools;
the doctor reads the tokens per tile from the checkpoint's config and names, with the sample,
an image file that is missing and image tokens that ``max_length`` cuts (exit 1). Neither tool
leaves XTuner's prompt templates edited for the configs that come after in the same process.
"""

import json
import runpy
from pathlib import Path

import internvl_configs as ic
import pytest
import torch

from xtuner_rope.cli import main
from xtuner_rope.models import channel


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> dict:
    assets = ic.internvl_assets(tmp_path_factory.mktemp("internvl"))
    root = tmp_path_factory.mktemp("internvl_configs")
    out = {}
    for name, model in ((ic.INTERNLM2_LORA, "internlm2"), (ic.PHI3_FULL, "phi3")):
        text = ic.localize_internvl(assets[name], assets[model], assets["data"])
        out[model] = root / f"{model}.py"
        out[model].write_text(ic.enable_plugin_internvl(text))
    out["assets"] = assets
    return out


@pytest.mark.parametrize("model", ["internlm2", "phi3"])
def test_doctor_and_check_pass_on_stock_configs(configs, model, tmp_path, capsys):
    assert main(["doctor", str(configs[model]), "--out", str(tmp_path / "doctor")]) == 0
    out = capsys.readouterr().out
    assert "InternVL: 16 LLM tokens per tile (from " in out, out
    assert "8 image and 8 text-only samples" in out, out
    # boundaries an earlier run of this process left published (CI's worker ran other files
    # first): the check starts from its own batches
    channel.publish(torch.tensor([0, 14, 25, 42, 57, 77, 96], dtype=torch.int32), 20)
    try:
        assert main(["check", str(configs[model]), "--out", str(tmp_path / "check")]) == 0
    finally:
        channel.clear()
    out = capsys.readouterr().out
    assert "PASS: each sample's LLM logits in the batch" in out, out
    report = json.loads((tmp_path / "check" / "report.json").read_text())
    assert report["multimodal"]["tokens_per_tile"] == 16
    assert report["batches"][0]["image_tokens"] > 0  # the batch holds images


def test_doctor_names_a_missing_image_file_with_the_sample(configs, tmp_path, capsys):
    data = json.loads(Path(configs["assets"]["data"]).read_text())
    gone = next(i for i, row in enumerate(data) if row.get("image"))
    data[gone]["image"] = "no_such_picture.png"
    moved = Path(configs["assets"]["data"]).with_name("missing.json")
    moved.write_text(json.dumps(data))
    config = tmp_path / "missing.py"
    config.write_text(
        configs["internlm2"].read_text().replace(str(configs["assets"]["data"]), str(moved))
    )
    assert main(["doctor", str(config), "--out", str(tmp_path / "doctor")]) == 1
    out = capsys.readouterr().out
    assert f"first: sample {gone} (id {data[gone]['id']}): " in out, out
    assert "no_such_picture.png): XTuner's InternVL_V1_5_Dataset prints the error" in out, out


def test_doctor_names_image_tokens_cut_by_max_length(configs, tmp_path, capsys):
    options = ["--cfg-options", "train_dataloader.dataset.max_length=40"]
    assert main(["doctor", str(configs["phi3"]), "--out", str(tmp_path / "d"), *options]) == 1
    out = capsys.readouterr().out
    assert "max_length=40: cuts the image tokens of 8 sample(s) (first: sample " in out, out
    assert "<IMG_CONTEXT> kept)" in out, out


def test_doctor_refuses_packed_rows_without_the_edit(configs, tmp_path, capsys):
    """``internvl_collate_fn`` without the plugin: ``InternVL_V1_5`` ignores the boundaries and
    the samples of a row would attend to each other; the doctor names it (exit 1)."""
    text = ic.with_internvl_collate(configs["phi3"].read_text())
    config = tmp_path / "packed_without_edit.py"
    config.write_text(text.replace(ic.PLUGIN_EDIT, ""))
    assert main(["doctor", str(config), "--out", str(tmp_path / "doctor")]) == 1
    out = capsys.readouterr().out
    assert "the data are packed: documents would attend to each other" in out, out


def test_doctor_and_check_leave_xtuner_prompt_templates_as_shipped(configs, tmp_path, capsys):
    """xtuner 0.2.0 ``InternVL_V1_5_Dataset`` rewrites the template a config hands it, which is
    XTuner's own ``PROMPT_TEMPLATE`` entry: without ``xtuner_internvl.patch_internvl_dataset_template``
    every text dataset built later in the process drops the newline after ``<|im_end|>``
    (the tiny recipe's rebuilt batches: ``real_token_share`` 0.892 where ``xtuner train``
    logged 0.9125)."""
    from xtuner.utils import PROMPT_TEMPLATE, templates

    shipped = runpy.run_path(templates.__file__)["PROMPT_TEMPLATE"]  # fresh from XTuner's file
    assert main(["doctor", str(configs["internlm2"]), "--out", str(tmp_path / "doctor")]) == 0
    assert main(["check", str(configs["phi3"]), "--out", str(tmp_path / "check")]) == 0
    capsys.readouterr()
    for name in ("internlm2_chat", "phi3_chat"):
        assert PROMPT_TEMPLATE[name].to_dict() == shipped[name].to_dict(), name


def _xtuner_items(config: Path, max_length: int) -> list[dict]:
    """XTuner's own ``InternVL_V1_5_Dataset`` items of ``config`` at ``max_length``."""
    from mmengine.config import Config
    from xtuner.registry import BUILDER

    cfg = Config.fromfile(str(config))
    cfg.train_dataloader.dataset.max_length = max_length
    dataset = BUILDER.build(cfg.train_dataloader.dataset)
    return [dataset[i] for i in range(len(dataset))]


def test_doctor_counts_what_max_length_cuts_against_xtuners_own_items(configs, tmp_path):
    """``InternVL_V1_5_Dataset`` cuts each item in ``__getitem__``: the doctor's count of the
    samples, tokens and supervised labels lost equals XTuner's items at ``max_length`` against
    its items uncut; a warning with the ``max_length`` that keeps every sample, and not OK."""
    from xtuner_rope.doctor.diagnose import diagnose
    from xtuner_rope.doctor.report import format_summary

    whole = _xtuner_items(configs["phi3"], 10**9)
    lengths = sorted(len(item["input_ids"]) for item in whole)
    max_length = lengths[len(lengths) // 2]  # the longer half is cut, images kept whole
    cut = _xtuner_items(configs["phi3"], max_length)

    def supervised(items):
        return sum(int((torch.as_tensor(x["labels"]) != -100).sum()) for x in items)

    options = {"train_dataloader.dataset.max_length": max_length}
    report, _ = diagnose(str(configs["phi3"]), options, batches=2, progress=False)
    figures = report["truncation"]
    assert figures["truncated"] == sum(n > max_length for n in lengths) > 0
    assert figures["tokens"]["lost"] == sum(lengths) - sum(len(x["input_ids"]) for x in cut) > 0
    assert figures["labels"]["lost"] == supervised(whole) - supervised(cut) > 0
    assert figures["keep_all"] == lengths[-1] and figures["dialogues"] == len(whole)
    assert report["samples"]["truncated"]["count"] == figures["truncated"]
    (warning,) = [w for w in report["warnings"] if "InternVL_V1_5_Dataset truncates" in w]
    assert f"-> set max_length = {lengths[-1]} (every dialogue whole)" in warning
    assert report["internvl"]["cut_images"] == [] and report["exit_code"] == 0
    summary = format_summary(report)
    assert summary.splitlines()[-1].startswith(
        f"TRUNCATED: {figures['truncated']} of {len(whole)} dialogues lose their ends"
    )
