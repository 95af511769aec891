"""The start-up's InternVL findings (``config.internvl``) on stock configs, read offline."""

import json

import pytest
import torch
from mmengine.config import Config

from xtuner_rope.compat.devices import cpu_only
from xtuner_rope.compat.xtuner_internvl import INTERNVL_LOAD
from xtuner_rope.config import startup
from xtuner_rope.config.findings import ConfigConflict
from xtuner_rope.config.internvl import internvl_findings


@pytest.fixture
def load_kept():
    kept = dict(INTERNVL_LOAD)
    INTERNVL_LOAD.clear()
    yield
    INTERNVL_LOAD.clear()
    INTERNVL_LOAD.update(kept)


def _stock(name: str, path=None) -> Config:
    from xtuner.configs import cfgs_name_path

    cfg = Config.fromfile(cfgs_name_path[name])
    if path is not None:
        cfg.model.model_path = str(path)
    return cfg


def _checkpoint(tmp_path, architecture: str, model_type: str):
    tmp_path.mkdir(parents=True, exist_ok=True)
    llm = {"architectures": [architecture], "model_type": model_type}
    (tmp_path / "config.json").write_text(json.dumps({"llm_config": llm}))
    return tmp_path


def test_fixes_set_the_load_and_are_not_found_again(load_kept, tmp_path):
    assert cpu_only()
    cfg = _stock(
        "internvl_v2_internlm2_2b_lora_finetune",
        _checkpoint(tmp_path, "InternLM2ForCausalLM", "internlm2"),
    )
    fixes = [f for f in internvl_findings(cfg) if f.fix is not None]
    assert [f.setting for f in fixes] == ["model (InternVL_V1_5)"] * 2
    for f in fixes:
        f.fix()
    assert INTERNVL_LOAD == {"attn_implementation": "eager", "torch_dtype": torch.float32}
    assert internvl_findings(cfg) == []  # the re-check before the first step finds nothing


def test_phi3_llm_gets_sdpa(load_kept, tmp_path):
    cfg = _stock("internvl_v2_phi3_4b_finetune", _checkpoint(tmp_path, "Phi3ForCausalLM", "phi3"))
    for f in internvl_findings(cfg):
        f.fix()
    assert INTERNVL_LOAD["attn_implementation"] == "sdpa"


def test_a_second_internvl_config_in_one_process_gets_its_own_llm_attention(load_kept, tmp_path):
    """The settings a first config's start-up chose do not stand for the next one."""
    internlm2 = _stock(
        "internvl_v2_internlm2_2b_lora_finetune",
        _checkpoint(tmp_path / "a", "InternLM2ForCausalLM", "internlm2"),
    )
    phi3 = _stock(
        "internvl_v2_phi3_4b_finetune", _checkpoint(tmp_path / "b", "Phi3ForCausalLM", "phi3")
    )
    for cfg, attn in ((internlm2, "eager"), (phi3, "sdpa"), (internlm2, "eager")):
        for f in internvl_findings(cfg):
            f.fix()
        assert INTERNVL_LOAD["attn_implementation"] == attn
        assert internvl_findings(cfg) == []


def test_an_llm_xtuner_cannot_template_is_refused(load_kept, tmp_path):
    cfg = _stock(
        "internvl_v2_internlm2_2b_lora_finetune", _checkpoint(tmp_path, "Qwen2ForCausalLM", "qwen2")
    )
    with pytest.raises(
        ConfigConflict,
        match=r"model.model_path: .*config.json: llm_config.architectures\[0\] = 'Qwen2ForCausalLM'",
    ):
        startup.prepare_config(cfg)


def test_packing_rows_shorter_than_the_dataset_are_raised_to_it(load_kept, tmp_path):
    from xtuner_rope.data.collate_internvl import internvl_collate_fn

    cfg = _stock("internvl_v2_phi3_4b_finetune", _checkpoint(tmp_path, "Phi3ForCausalLM", "phi3"))
    cfg.train_dataloader.collate_fn = dict(type=internvl_collate_fn, max_length=1024)
    (fix,) = [f for f in internvl_findings(cfg) if f.setting.startswith("train_dataloader")]
    fix.fix()
    assert cfg.train_dataloader.collate_fn.max_length == 8192  # the dataset's max_length
    assert not [f for f in internvl_findings(cfg) if f.setting.startswith("train_dataloader")]


def test_llava_collate_on_internvl_samples_is_refused(load_kept, tmp_path):
    from xtuner_rope.data.collate_llava import llava_collate_fn

    cfg = _stock("internvl_v2_phi3_4b_finetune", _checkpoint(tmp_path, "Phi3ForCausalLM", "phi3"))
    cfg.train_dataloader.collate_fn = dict(type=llava_collate_fn, max_length=1024, image_tokens=256)
    with pytest.raises(
        ConfigConflict,
        match="train_dataloader.collate_fn: llava_collate_fn on InternVL samples",
    ):
        startup.prepare_config(cfg)
