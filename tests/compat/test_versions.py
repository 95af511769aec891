"""torch or DeepSpeed outside the supported range: one clear message at import and at start-up.

The releases are simulated the way ``test_patch_guard`` simulates them (the version string the
guard reads); the configs and the start-up are the real ones. The releases themselves ran in
``make test-compat`` (tools/test_compat.sh, docs/compat.md).
"""

from __future__ import annotations

import warnings

import pytest
from mmengine.config import Config

from xtuner_rope import compat
from xtuner_rope.compat import guard, records, runner_checkpoints, versions
from xtuner_rope.config.findings import ConfigConflict
from xtuner_rope.config.patch_needs import patch_findings, version_findings
from xtuner_rope.config.startup import prepare_config

ZERO2 = dict(type="DeepSpeedStrategy", config=dict(zero_optimization=dict(stage=2)))


@pytest.fixture
def installed(monkeypatch):
    """Pretend the given releases are installed: ``installed(torch="2.3.1")``.

    Every patch is judged again (the guard recognises the wrappers of those applied here).
    """
    monkeypatch.setattr(guard, "_OUTCOMES", {})
    monkeypatch.setattr(versions, "_WARNED", set())
    real = guard.metadata.version

    def pretend(**found: str) -> None:
        monkeypatch.setattr(guard.metadata, "version", lambda d: found.get(d) or real(d))

    return pretend


def _warned(call) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    return [str(w.message) for w in caught if w.category is versions.UnsupportedVersionWarning]


def test_the_installed_pins_are_inside_the_range():
    assert versions.unsupported() == {}


@pytest.mark.parametrize("version", ["2.4.0", "2.4.1+cu121", "2.15.0", "2.16.0.dev20261101+cpu"])
def test_torch_inside_the_range(installed, version):
    installed(torch=version)
    assert "torch" not in versions.unsupported()


def test_an_older_torch_is_warned_once_and_every_config_refused(installed):
    installed(torch="2.3.1")
    messages = _warned(compat.apply) + _warned(compat.apply)
    assert len(messages) == 1, messages  # once per process, not once per apply()
    assert "torch 2.3.1 is outside the versions xtuner-rope supports" in messages[0]
    assert "torch>=2.4" in messages[0] and "pip install 'torch>=2.4'" in messages[0]
    assert "torchvision" in messages[0]  # the pair that must move with torch
    with pytest.raises(ConfigConflict, match=r"the installed torch .*torch 2\.3\.1 is outside"):
        prepare_config(Config(dict(model=dict(type="SupervisedFinetune"))))


def test_a_torch_outside_the_range_is_one_message_not_one_per_patch(installed):
    installed(torch="2.3.1")
    compat.run_patch(runner_checkpoints.patch_checkpoint_loading)  # written for torch>=2.4: skipped
    assert "patch_checkpoint_loading" in guard.skipped()
    cfg = Config(dict(load_from="iter_1.pth"))
    assert patch_findings(cfg) == []
    assert [f.setting.split(" (")[0] for f in version_findings(cfg)] == ["the installed torch"]


def test_a_newer_deepspeed_refuses_deepspeed_runs_only(installed):
    installed(deepspeed="0.19.8")
    (message,) = _warned(compat.apply)
    assert "deepspeed 0.19.8 is outside" in message
    assert "deepspeed.runtime.fp16.onebit" in message  # why: mmengine 0.10.6 cannot import it
    assert "pip install 'deepspeed>=0.17.6,<0.19.7'" in message
    assert version_findings(Config(dict(model=dict(type="SupervisedFinetune")))) == []
    with pytest.raises(ConfigConflict, match=r"the installed deepspeed .*deepspeed 0\.19\.8"):
        prepare_config(Config(dict(strategy=ZERO2)))


def test_an_older_deepspeed_is_refused_too(installed):
    installed(deepspeed="0.16.2")  # xtuner 0.2.0's own [deepspeed] extra
    (finding,) = version_findings(Config(dict(optim_wrapper=dict(type="DeepSpeedOptimWrapper"))))
    assert "deepspeed 0.16.2 is outside" in finding.problem
    assert finding.edit == "pip install 'deepspeed>=0.17.6,<0.19.7'"


def test_a_version_string_that_is_not_pep440_counts_as_outside(installed):
    installed(torch="nightly")
    assert "torch nightly is outside" in versions.unsupported()["torch"]


def test_the_patch_records_take_their_ranges_from_here():
    for record in records.RECORDS.values():
        for dist in set(record.versions) & set(versions.SUPPORTED):
            assert record.versions[dist] == versions.SUPPORTED[dist].spec, record.name
