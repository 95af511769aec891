"""The start-up turns ``save_optimizer`` on: a resume continues the optimizer."""

import itertools

import pytest
from mmengine.config import Config

from xtuner_rope.config.optimizer_state import KEEP_OFF_KEY, save_optimizer_findings


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


_NAMES = itertools.count()  # one MMEngine experiment name per runner


def _resume_log(tmp_path, capsys, save_optimizer: bool, resume: bool) -> str:
    """Save a toy checkpoint with or without the optimizer, then load it through MMEngine."""
    import torch
    from mmengine.logging import MMLogger
    from mmengine.model import BaseModel
    from mmengine.runner import Runner

    from xtuner_rope.hooks.random_state import RandomStateHook

    class _Toy(BaseModel):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(2, 1)

        def forward(self, inputs, data_samples=None, mode="loss"):
            return {"loss": self.linear(inputs).pow(2).mean()}

    def runner(load_from=None, resume=False):
        return Runner(
            model=_Toy(),
            work_dir=str(tmp_path),
            experiment_name=f"optimizer_state_{next(_NAMES)}",
            train_dataloader=dict(
                dataset=[{"inputs": torch.ones(2)}] * 4,
                sampler=dict(type="DefaultSampler", shuffle=False),
                batch_size=2,
                collate_fn=dict(type="default_collate"),
            ),
            train_cfg=dict(by_epoch=False, max_iters=2),
            optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.1, momentum=0.9)),
            custom_hooks=[RandomStateHook()],
            load_from=load_from,
            resume=resume,
        )

    first = runner()
    first.train()
    path = tmp_path / "saved.pth"
    first.save_checkpoint(str(tmp_path), path.name, save_optimizer=save_optimizer)
    MMLogger.get_instance("optimizer_state_resume")  # a fresh logger writing to this stdout
    capsys.readouterr()
    runner(load_from=str(path), resume=resume).load_or_resume()
    return capsys.readouterr().out


@pytest.mark.parametrize(
    "save_optimizer,resume,warned",
    [(False, True, True), (True, True, False), (False, False, False)],
    ids=["resume-without-optimizer", "resume-with-optimizer", "load-from-weights-only"],
)
def test_resume_from_a_checkpoint_without_optimizer_state_warns(
    tmp_path, capsys, save_optimizer, resume, warned
):
    out = _resume_log(tmp_path, capsys, save_optimizer, resume)
    assert ("holds no optimizer state" in out) is warned, out[-2000:]
    if warned:
        assert "(iteration 2)" in out and "the optimizer starts afresh" in out
