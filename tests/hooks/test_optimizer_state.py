"""The start-up turns ``save_optimizer`` on: a resume continues the optimizer."""

import pytest
from mmengine.config import Config

from xtuner_rope.hooks.optimizer_state import KEEP_OFF_KEY, save_optimizer_findings


def _cfg(**top):
    hook = dict(type="CheckpointHook", by_epoch=False, interval=4, save_optimizer=False)
    return Config(dict(default_hooks=dict(checkpoint=hook), **top))


def test_save_optimizer_is_turned_on():
    cfg = _cfg()
    (finding,) = save_optimizer_findings(cfg)
    assert finding.setting == "default_hooks.checkpoint.save_optimizer"
    assert "restarts the optimizer (momentum, AdamW's moments) from zero" in finding.problem
    assert finding.edit.startswith("set to True: every checkpoint resumes exactly")
    assert KEEP_OFF_KEY in finding.edit  # the way to keep the small checkpoints
    finding.fix()
    assert cfg.default_hooks.checkpoint.save_optimizer is True
    assert save_optimizer_findings(cfg) == []


@pytest.mark.parametrize(
    "cfg",
    [
        _cfg(**{KEEP_OFF_KEY: True}),
        Config(dict(default_hooks=dict(checkpoint=dict(type="CheckpointHook", interval=4)))),
        Config(dict(default_hooks=dict(checkpoint=dict(type="MyHook", save_optimizer=False)))),
        Config(dict()),
    ],
    ids=["kept-off-by-the-user", "default-on", "not-mmengine-hook", "no-hook"],
)
def test_nothing_to_turn_on(cfg):
    assert save_optimizer_findings(cfg) == []


def test_stock_internvl_config_gets_the_fix_from_the_start_up():
    """The registered finding reaches the start-up (and the doctor) on XTuner's stock config."""
    from xtuner.configs import cfgs_name_path

    from xtuner_rope.config import startup

    cfg = Config.fromfile(cfgs_name_path["internvl_v2_phi3_4b_finetune"])
    assert cfg.default_hooks.checkpoint.save_optimizer is False  # as XTuner ships it
    findings = [f for f in startup.inspect_config(cfg) if f.setting.endswith("save_optimizer")]
    assert len(findings) == 1 and findings[0].fix is not None, findings
