"""XTuner's Hugging Face ``Trainer`` configs (``framework = "huggingface"``) are refused at the
start-up: the plugin's hooks and collate function never run under that trainer."""

import pytest
from mmengine.config import Config

import xtuner_rope
from xtuner_rope.config.findings import ConfigConflict
from xtuner_rope.config.frameworks import huggingface_trainer_findings
from xtuner_rope.config.startup import prepare_config

xtuner_rope.activate()


def test_a_stock_huggingface_trainer_config_is_refused_from_the_config_alone():
    from xtuner.configs import cfgs_name_path

    cfg = Config.fromfile(cfgs_name_path["llama2_70b_qlora_open_platypus_e1_hf"])
    with pytest.raises(
        ConfigConflict,
        match=r"(?s)framework: 'huggingface': XTuner trains this config with transformers' "
        r"Trainer, which runs no MMEngine hook.*packed documents would attend to each other"
        r".*-> train with XTuner's MMEngine config of the same recipe",
    ):
        prepare_config(cfg)


def test_an_mmengine_config_has_no_framework_finding():
    """The control: the same recipe's MMEngine config (and a config without the setting)."""
    from xtuner.configs import cfgs_name_path

    cfg = Config.fromfile(cfgs_name_path["llama2_70b_qlora_open_platypus_e1"])
    assert huggingface_trainer_findings(cfg) == []
    (finding,) = huggingface_trainer_findings(Config(dict(framework="HuggingFace")))
    assert finding.setting == "framework" and "would attend" not in finding.problem
