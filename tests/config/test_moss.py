"""``MOSSSFTDataset`` data files without ``.jsonl`` in their name are refused at the start-up:
XTuner would read (or overwrite) the data file as its own token cache."""

import pytest
from mmengine.config import Config

import xtuner_rope
from xtuner_rope.config.findings import ConfigConflict
from xtuner_rope.config.moss import moss_data_file_findings
from xtuner_rope.config.startup import prepare_config

xtuner_rope.activate()
STOCK = "llama_7b_qlora_moss_sft_all_e1"


def test_a_moss_data_file_without_jsonl_is_refused_by_name():
    from xtuner.configs import cfgs_name_path

    cfg = Config.fromfile(cfgs_name_path[STOCK])
    cfg.train_dataloader.dataset.datasets[1].data_file = "/data/moss/with_tools.json"
    with pytest.raises(
        ConfigConflict,
        match=r"(?s)train_dataloader\.dataset\.datasets\[1\]\.data_file: '/data/moss/with_tools"
        r"\.json': MOSSSFTDataset names its token cache by replacing '\.jsonl'.*"
        r"-> give the MOSS data file a name ending in \.jsonl",
    ):
        prepare_config(cfg)


def test_the_stock_moss_names_have_no_finding():
    """The control: the stock config's own ``.jsonl`` names."""
    from xtuner.configs import cfgs_name_path

    cfg = Config.fromfile(cfgs_name_path[STOCK])
    assert moss_data_file_findings(cfg) == []
    cfg.train_dataloader.dataset.datasets[0].data_file = "moss.json"
    (finding,) = moss_data_file_findings(cfg)
    assert finding.setting == "train_dataloader.dataset.datasets[0].data_file"
