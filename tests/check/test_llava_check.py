"""``xtuner-rope doctor`` and ``xtuner-rope check`` on XTuner's stock LLaVA configs.

The stock finetune and pretrain configs, copied with ``xtuner copy-cfg``, localized
(``llava_configs.localize_llava``) with the README's one edit, on a tiny CLIP (16 patch tokens
per image) + tiny InternLM2 with hub-style remote code and 12 drawn-image + 12 text-only short
dialogues. The doctor must count each image as the 16 tokens the LLM sees; the check must run
the real ``LLaVAModel`` and find each sample's LLM logits in the padded and in the
``llava_collate_fn``-packed batch equal to the sample alone, and fail (with the figure) on
the packed rows of the config without the edit. The check's real expansion gives the
reference lengths for the doctor's arithmetic.
"""

import json
from pathlib import Path

import llava_configs as lc
import pytest

from xtuner_rope.check import run_check
from xtuner_rope.check.report import TOLERANCES
from xtuner_rope.cli import main
from xtuner_rope.doctor.diagnose import diagnose
from xtuner_rope.doctor.llava_stats import image_tokens_of

P = 16  # tiny CLIP: (56 // 14) ** 2

pytestmark = pytest.mark.slow  # real model builds and passes (run in CI)


@pytest.fixture(scope="module")
def llava(tmp_path_factory) -> dict:
    assets = lc.llava_assets(tmp_path_factory.mktemp("llava_dc"))
    root = assets["root"]
    offline = {}
    for stock in ("finetune", "pretrain"):  # tokenized once (each build would take ~20 s)
        plain = root / f"{stock}_online.py"
        plain.write_text(
            lc.localize_llava(assets[stock], assets["llm"], assets["clip"], assets["data"])
        )
        offline[stock] = lc.save_offline_text(plain, root / f"{stock}_text")

    def write(name: str, stock: str, edit: bool = True, packed: bool = False) -> Path:
        text = lc.localize_llava(assets[stock], assets["llm"], assets["clip"], assets["data"])
        text = lc.with_offline_text(text, offline[stock])
        text = lc.enable_plugin_llava(text) if edit else text
        path = root / f"{name}.py"
        path.write_text(lc.with_llava_collate(text) if packed else text)
        return path

    return {
        **assets,
        "configs": {
            "finetune": write("finetune", "finetune"),
            "pretrain_packed": write("pretrain_packed", "pretrain", packed=True),
            "finetune_packed": write("finetune_packed", "finetune", packed=True),
            "finetune_packed_no_edit": write(
                "finetune_packed_no_edit", "finetune", edit=False, packed=True
            ),
        },
    }


@pytest.fixture(scope="module")
def finetune_doctor(llava):
    return diagnose(str(llava["configs"]["finetune"]), progress=False)


def _passes(report: dict) -> None:
    tol = TOLERANCES["float32"]
    assert report["kind"] == "llava" and report["plugin"]["patched"], report["plugin"]
    for batch in report["batches"]:
        assert all(
            d["max_abs_diff"] <= tol["logits"] * max(1, d["max_abs_logit"]) for d in batch["logits"]
        ), batch["logits"]
    assert report["grads"]["max_abs_grad"] > 0
    assert report["exit_code"] == 0 and report["problems"] == [], report["problems"]


def test_doctor_counts_each_image_as_the_llm_sees_it(finetune_doctor):
    report, lengths = finetune_doctor
    m = report["multimodal"]
    assert report["exit_code"] == 0, report["problems"]
    assert m["image_tokens"] == P and (m["image_samples"], m["text_samples"]) == (12, 12)
    raw_total = sum(lengths) - 12 * (P - 1)
    assert report["dataset"]["tokens"] == sum(lengths) == m["tokens_expanded"]
    assert m["image_tokens_total"] == 12 * P
    assert m["image_token_share"] == pytest.approx(12 * P / sum(lengths))
    assert m["lengths_as_dataset"]["p100"] <= max(lengths) and raw_total > 0
    c = report["collate"]
    assert c["real_tokens"] == sum(lengths) and c["padded_slots"] == c["config_slots"]
    order = m["sampler_order"]  # the stock LengthGroupedSampler's batches, padded
    from mmengine.config import Config
    from xtuner.dataset.samplers import LengthGroupedSampler
    from xtuner.registry import BUILDER

    cfg = Config.fromfile(report["config"])
    dataset = BUILDER.build(cfg.train_dataloader.dataset)
    indices = list(LengthGroupedSampler(dataset, 4, "modality_length", seed=0))
    batches = [indices[i : i + 4] for i in range(0, 24, 4)]
    share = sum(lengths) / sum(4 * max(lengths[i] for i in b) for b in batches)
    assert order["sampler"] == "LengthGroupedSampler" and order["padded_share"] == share


def test_check_padded_stock_finetune_passes_and_its_expansion_is_the_doctors_count(
    llava, finetune_doctor, tmp_path
):
    """All 24 samples (6 padded batches of 4) through the real LLaVAModel: each alone has the
    length the doctor counted, and each equals itself in the padded batch."""
    report = run_check(
        str(llava["configs"]["finetune"]), batches=6, work_dir=tmp_path, max_documents=8
    )
    _passes(report)
    alone = [n for b in report["batches"] for n in b["expansion"]["samples_alone"]]
    assert alone == finetune_doctor[1]  # the doctor's lengths, in dataset order
    assert all(
        b["expansion"]["rows_expanded"] == b["expansion"]["rows_predicted"]
        for b in report["batches"]
    )
    assert sum(b["image_samples"] for b in report["batches"]) == 12
    cut = run_check(
        str(llava["configs"]["finetune"]), batches=1, work_dir=tmp_path / "cut", max_documents=2
    )  # whole rows kept, with the images they take
    _passes(cut)
    assert cut["batches"][0]["rows"] == cut["batches"][0]["documents"] == 2
    assert cut["batches"][0]["expansion"]["samples_alone"] == finetune_doctor[1][:2]


def test_check_packed_stock_pretrain_passes_with_projector_gradients(llava, tmp_path):
    report = run_check(str(llava["configs"]["pretrain_packed"]), batches=1, work_dir=tmp_path)
    _passes(report)
    batch = report["batches"][0]
    assert batch["rows"] == 1 and batch["documents"] == 4, batch  # one packed row
    assert batch["boundaries"].startswith("cumulative_len")
    assert report["grads"]["trained"] == ["projector"]  # freeze_llm=True in the stock config


def test_check_fails_on_packed_rows_without_the_edit(llava, tmp_path, capsys):
    config = llava["configs"]["finetune_packed_no_edit"]
    assert main(["check", str(config), "--out", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "report.json").read_text())
    assert not report["plugin"]["patched"]
    assert report["figures"]["logits"]["max_abs_diff"] > 1e-2, report["figures"]
    assert "FAIL: logits: a packed document differs from the same document alone by" in out
    assert "xtuner-rope's patch is not applied" in out
    print(f"unpatched packed LLaVA rows: {report['figures']['logits']['max_abs_diff']:.3g}")


def test_doctor_plans_packed_rows_on_expanded_lengths_and_names_llava_mistakes(llava):
    config = str(llava["configs"]["finetune_packed"])
    report, lengths = diagnose(config, progress=False)
    c = report["collate"]
    assert report["exit_code"] == 0, report["problems"]
    assert c["rows_per_step"]["max"] < 4 and c["config_share"] > c["padded_share"]
    assert c["real_tokens"] == sum(lengths)
    bad, _ = diagnose(
        config,
        {
            "train_dataloader.collate_fn.image_tokens": 4,
            "train_dataloader.dataset.image_folder": "/nonexistent",
        },
        batches=2,
        progress=False,
    )
    assert bad["exit_code"] == 1
    text = "\n".join(bad["problems"])
    assert (  # the start-up's finding (config.llava_tower), the one xtuner train meets
        "conflict: train_dataloader.collate_fn.image_tokens: set after the start-up ran "
        "(--cfg-options): 4, but the vision tower" in text
    )
    assert "-> set image_tokens=16" in text
    assert "train_dataloader.dataset.image_folder: 12 of 12 samples name an image" in text
    assert "its image cannot be opened" in text
    leaky, _ = diagnose(str(llava["configs"]["finetune_packed_no_edit"]), progress=False)
    assert leaky["exit_code"] == 1 and leaky["packed"]  # llava_collate_fn rows, no plugin
    assert "the data are packed: documents would attend to each other" in leaky["problems"][0]


def test_llava_settings_against_the_tower_name_the_setting(llava, tmp_path):
    from mmengine.config import Config
    from transformers import CLIPImageProcessor

    from xtuner_rope.config.llava_tower import crop_size_findings

    cfg = Config.fromfile(str(llava["configs"]["finetune"]))
    assert crop_size_findings(cfg) == []
    other = CLIPImageProcessor(crop_size={"height": 64, "width": 64})
    other.save_pretrained(tmp_path / "processor")
    cfg.train_dataloader.dataset.image_processor.pretrained_model_name_or_path = str(
        tmp_path / "processor"
    )
    (finding,) = crop_size_findings(cfg)
    assert finding.setting == "image_processor" and finding.fix is None
    assert finding.problem.startswith("crops images to 64x64, but the vision tower")
    cfg = Config.fromfile(str(llava["configs"]["finetune"]))
    assert image_tokens_of(cfg)["image_tokens"] == P
    cfg.model.visual_encoder.pretrained_model_name_or_path = str(llava["llm"])
    with pytest.raises(
        ValueError,
        match=r"model.visual_encoder \(.*\): expected a ViT-style "
        r"config with int image_size and patch_size, got image_size=None",
    ):
        image_tokens_of(cfg)
    cfg.model.visual_encoder.pretrained_model_name_or_path = None
    with pytest.raises(
        ValueError,
        match=r"model.visual_encoder.pretrained_model_name_or_path: "
        r"expected the vision tower's path, got none",
    ):
        image_tokens_of(cfg)


def test_internvl_qlora_is_refused_by_doctor_and_check_before_its_data(tmp_path, capsys):
    import stock_configs as sc
    from xtuner.configs import cfgs_name_path

    text = Path(cfgs_name_path["internvl_v2_internlm2_2b_qlora_finetune"]).read_text()
    config = tmp_path / "internvl.py"
    config.write_text(sc.sub_once(text, r"^(path = .*\n)", r"\g<1>" + sc.PLUGIN_EDIT))
    for command in ("doctor", "check"):
        assert main([command, str(config), "--out", str(tmp_path / command)]) == 1
        assert "model.quantization_llm: True on this CPU-only machine" in capsys.readouterr().out
