"""Patches of other packages fail safe (issue 47 item 2): skipped with one warning, then refused.

Each way a release can break a patch is simulated on the real classes: a private method
renamed (deleted), a newer version (the version string the guard reads), a missing module,
a patch that raises. ``import xtuner_rope`` still works, one ``CompatPatchSkipped`` names the
feature, and the start-up refuses exactly the configs that need that feature.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import types
import warnings

import pytest
from mmengine.config import Config
from mmengine.hooks import CheckpointHook

from xtuner_rope import compat
from xtuner_rope.compat import (
    guard,
    mmengine_config,
    records,
    runner_checkpoints,
    xtuner_packing,
    xtuner_zero_read,
)
from xtuner_rope.config.findings import ConfigConflict
from xtuner_rope.config.patch_needs import patch_findings
from xtuner_rope.config.startup import prepare_config
from xtuner_rope.data.preference_truncation import counted_preference_dataset
from xtuner_rope.data.truncation import counted_tokenize_step

WRITES = records.RECORDS["patch_checkpoint_writes"]
FEATURE = "crash-safe checkpoint writes"


@pytest.fixture
def fresh(monkeypatch):
    """This process's patch outcomes as a fresh process has them, put back afterwards.

    A patch run again is judged again (versions, probes); one whose probes still hold its own
    wrappers is recognised as applied by the guard, not wrapped twice.
    """
    monkeypatch.setattr(guard, "_OUTCOMES", {})


def _with_checkpoint_hook() -> Config:
    return Config(dict(default_hooks=dict(checkpoint=dict(type=CheckpointHook, interval=1))))


def _skips(call) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    return [w for w in caught if issubclass(w.category, guard.CompatPatchSkipped)]


def test_renamed_private_method_skips_the_patch_and_the_startup_refuses(fresh, monkeypatch):
    monkeypatch.delattr(CheckpointHook, "_save_checkpoint_with_step")
    caught = _skips(lambda: compat.run_patch(runner_checkpoints.patch_checkpoint_writes))
    assert len(caught) == 1
    message = str(caught[0].message)
    assert FEATURE in message and "_save_checkpoint_with_step is missing" in message
    assert "mmengine ~=0.10.6" in message and "mmengine 0.10.6" in message
    assert "_save_checkpoint_with_step" in guard.skipped()["patch_checkpoint_writes"]
    assert (
        _skips(lambda: compat.run_patch(runner_checkpoints.patch_checkpoint_writes)) == []
    )  # one warning
    with pytest.raises(ConfigConflict, match=r"crash-safe checkpoint writes \(every run.*skipped"):
        prepare_config(_with_checkpoint_hook())


def test_a_config_that_does_not_need_the_feature_is_not_refused(fresh, monkeypatch):
    monkeypatch.delattr(CheckpointHook, "_save_checkpoint_with_step")
    _skips(lambda: compat.run_patch(runner_checkpoints.patch_checkpoint_writes))
    assert patch_findings(Config(dict(default_hooks=dict(checkpoint=None)))) == []
    assert len(patch_findings(_with_checkpoint_hook())) == 1


def test_a_newer_release_skips_the_patch(fresh, monkeypatch):
    real = guard.metadata.version
    monkeypatch.setattr(
        guard.metadata, "version", lambda d: "0.11.0" if d == "mmengine" else real(d)
    )
    caught = _skips(lambda: compat.run_patch(runner_checkpoints.patch_checkpoint_writes))
    assert len(caught) == 1
    assert "mmengine 0.11.0 is outside the versions it was written for" in str(caught[0].message)
    assert "pip install 'mmengine~=0.10.6'" in str(caught[0].message)
    assert [f.setting.split(" (")[0] for f in patch_findings(_with_checkpoint_hook())] == [FEATURE]


DS_ENGINE = "deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine"


def test_a_deepspeed_that_moves_its_checkpoint_engine_skips_its_write_patch(fresh, monkeypatch):
    """DeepSpeed's rank files have their own record: a moved engine is reported, not applied."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    save = TorchCheckpointEngine.save
    monkeypatch.setitem(sys.modules, DS_ENGINE, None)  # import -> ImportError
    caught = _skips(lambda: compat.run_patch(runner_checkpoints.patch_deepspeed_checkpoint_writes))
    assert len(caught) == 1, [str(w.message) for w in caught]
    message = str(caught[0].message)
    assert "crash-safe DeepSpeed checkpoint writes" in message
    assert f"{DS_ENGINE}:TorchCheckpointEngine.save is missing" in message
    assert "patch_deepspeed_checkpoint_writes" not in compat.applied()
    assert TorchCheckpointEngine.save is save  # left as it was
    deepspeed_run = Config(
        dict(
            default_hooks=dict(checkpoint=dict(type=CheckpointHook, interval=1)),
            strategy=dict(type="DeepSpeedStrategy"),
        )
    )
    (finding,) = patch_findings(deepspeed_run)
    assert "crash-safe DeepSpeed checkpoint writes (DeepSpeed runs" in finding.setting
    assert patch_findings(_with_checkpoint_hook()) == []  # not a DeepSpeed run: not refused


def test_a_newer_deepspeed_skips_its_write_patch(fresh, monkeypatch):
    real = guard.metadata.version
    monkeypatch.setattr(
        guard.metadata, "version", lambda d: "0.20.0" if d == "deepspeed" else real(d)
    )
    caught = _skips(lambda: compat.run_patch(runner_checkpoints.patch_deepspeed_checkpoint_writes))
    assert len(caught) == 1
    assert "deepspeed 0.20.0 is outside the versions it was written for" in str(caught[0].message)
    compat.run_patch(
        runner_checkpoints.patch_checkpoint_writes
    )  # MMEngine's writes: their own record
    assert guard.outcomes()["patch_checkpoint_writes"] == "applied"


def _apply_all() -> None:
    """What ``xtuner_rope.activate`` applies: ``compat.apply`` and the two counting patches."""
    compat.apply()
    compat.apply_counting(counted_tokenize_step, counted_preference_dataset)


def test_a_missing_module_skips_a_deferred_patch_and_its_use_is_refused(fresh, monkeypatch):
    monkeypatch.setitem(sys.modules, "xtuner.dataset.huggingface", None)  # import -> ImportError
    # checked at import, though applied for one call later: the two that live in that module;
    # and the count of the unpacked builds' cut, applied at import
    counted, pack, tokenize = sorted(
        (str(w.message) for w in _skips(_apply_all)),
        key=lambda m: ("whole-dialogue" in m) + 2 * ("every truncation" in m),
    )
    assert "truncation counted on unpacked process_hf_dataset" in counted
    assert "whole-dialogue packing (lossless_process_hf_dataset)" in pack
    assert "xtuner.dataset.huggingface:pack_dataset is missing" in pack
    assert "every truncation counted" in tokenize and "tokenize_dataset is missing" in tokenize
    with pytest.raises(guard.CompatPatchUnavailable, match="whole-dialogue packing.*unpatched"):
        with xtuner_packing.xtuner_pack_step(lambda *a, **k: None):
            pass
    packed = Config(
        dict(train_dataloader=dict(dataset=dict(type="process_hf_dataset", max_length=64)))
    )
    pack, tokenize = patch_findings(packed)
    assert "whole-dialogue packing" in pack.setting and "xtuner ~=0.2.0" in pack.edit
    assert "every truncation counted" in tokenize.setting


def test_a_patch_that_raises_is_skipped_not_raised(fresh):
    def patch_that_breaks():
        raise KeyError("renamed_private")

    record = guard.PatchRecord(
        "patch_that_breaks", {"torch": ">=2.4"}, ("torch",), "a feature", "s"
    )
    with pytest.warns(guard.CompatPatchSkipped, match="'a feature' is unavailable.*KeyError"):
        assert guard.run_guarded(record, patch_that_breaks) is False


def test_an_uninstalled_package_is_not_a_skip(fresh):
    record = guard.PatchRecord("p", {"no-such-dist-xtr": ">=1"}, ("no_such_module",), "f", "s")
    assert _skips(lambda: guard.run_guarded(record, lambda: True)) == []
    assert guard.outcomes()["p"] == "not needed: no-such-dist-xtr is not installed"


def test_config_dict_names_the_mmengine_to_install():
    cfg = Config(dict(a=1))
    assert mmengine_config.config_dict(cfg) is cfg._cfg_dict
    with pytest.raises(
        mmengine_config.ConfigDictUnavailable, match=r"has no _cfg_dict.*mmengine~=0\.10"
    ):
        mmengine_config.config_dict(object())


# slow: one fresh interpreter importing the whole stack (~10 s idle, ~28 s on the shared box);
# the claim is the plugin's activation itself with the method gone first, which needs one.
@pytest.mark.slow
def test_import_succeeds_with_the_private_method_removed_and_the_startup_refuses():
    """The issue's done-when, in a fresh interpreter: removed before the plugin activates."""
    code = textwrap.dedent(
        """
        import warnings
        from mmengine.hooks import CheckpointHook
        del CheckpointHook._save_checkpoint_with_step
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import xtuner_rope
            xtuner_rope.activate()
        from mmengine.config import Config
        from xtuner_rope.compat import guard
        from xtuner_rope.config.findings import ConfigConflict
        from xtuner_rope.config.startup import prepare_config
        skips = [w for w in caught if w.category is guard.CompatPatchSkipped]
        print("WARNINGS", len(skips), skips[0].message)
        print("SKIPPED", sorted(guard.skipped()))
        cfg = Config(dict(default_hooks=dict(checkpoint=dict(type=CheckpointHook))))
        try:
            prepare_config(cfg)
        except ConfigConflict as error:
            print("REFUSED", error)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "WARNINGS 1 " in proc.stdout and FEATURE in proc.stdout
    assert "SKIPPED ['patch_checkpoint_writes']" in proc.stdout
    refused = proc.stdout.split("REFUSED", 1)[1]
    assert FEATURE in refused and "patch_checkpoint_writes" in refused
    assert "mmengine ~=0.10.6" in refused


def test_convert_of_a_deepspeed_folder_is_refused_when_the_fp32_read_is_skipped(
    fresh, monkeypatch, tmp_path, capsys
):
    """Without its fp32 read XTuner would convert a ZeRO folder's weights as fp16: refused."""
    import xtuner.utils.zero_to_any_dtype as reader

    from xtuner_rope.outputs.xtuner_tools import run_xtuner_tool

    monkeypatch.delattr(reader, "DEFAULT_DTYPE")
    (caught,) = _skips(lambda: compat.run_patch(xtuner_zero_read.patch_xtuner_zero_read_fp32))
    assert "DeepSpeed checkpoints read at fp32" in str(caught.message)
    folder = tmp_path / "iter_8.pth"
    folder.mkdir()  # a DeepSpeed checkpoint is a folder
    status = run_xtuner_tool(
        ("convert", "pth_to_hf"), ["config.py", str(folder), str(tmp_path / "hf")]
    )
    err = capsys.readouterr().err
    assert status == 2 and f"refused: {folder} is a DeepSpeed checkpoint" in err
    assert "DEFAULT_DTYPE is missing" in err and "as fp16" in err


def test_the_guard_runs_a_patch_once_per_process(fresh):
    """ "Already applied" is the guard's: the patch functions keep no marker of their own."""
    calls = []
    record = guard.PatchRecord("patch_counted", {"torch": ">=2.4"}, ("torch",), "f", "s")
    assert guard.run_guarded(record, lambda: calls.append(1) or True) is True
    assert guard.run_guarded(record, lambda: calls.append(1) or True) is True
    assert calls == [1] and compat.applied()[-1] == "patch_counted"
    # a patch applied for one call (records.DEFERRED: a config's paths) runs at every call
    assert guard.run_guarded(record, lambda: calls.append(2) or True, once=False) is True
    assert calls == [1, 2]


def test_at_least_reads_the_installed_release():
    import torch
    from packaging.version import Version

    release = ".".join(map(str, Version(torch.__version__).release))
    assert guard.at_least("torch", release) and guard.at_least("torch", "2.4")
    assert not guard.at_least("torch", "999.0")
    assert not guard.at_least("no-such-dist-xtr", "0")  # not installed: never "at least"


def test_the_guard_knows_its_own_wrapper_after_its_outcomes_are_reset(fresh, monkeypatch):
    """Outcomes forgotten (a fresh fixture): a wrapping patch is recognised, not wrapped twice;
    with its wrapper gone (the original put back) it is applied again."""
    module = types.ModuleType("xtr_guard_target")
    module.f = lambda: 1
    monkeypatch.setitem(sys.modules, "xtr_guard_target", module)
    monkeypatch.setattr(guard, "_LEFT", dict(guard._LEFT))
    record = guard.PatchRecord("patch_wraps", {"torch": ">=2.4"}, ("xtr_guard_target:f",), "f", "s")

    def wrap():
        original = module.f
        module.f = lambda: original() + 1
        return True

    assert guard.run_guarded(record, wrap) and module.f() == 2
    monkeypatch.setattr(guard, "_OUTCOMES", {})
    assert guard.run_guarded(record, wrap) is True and module.f() == 2
    module.f = lambda: 1
    monkeypatch.setattr(guard, "_OUTCOMES", {})
    assert guard.run_guarded(record, wrap) is True and module.f() == 2


def test_every_applied_patch_run_again_leaves_its_targets_as_they_were(fresh):
    compat.apply()  # applied here if not yet (the guard keeps what each one left)
    applied = [records.RECORDS[name] for name in guard._LEFT if name in records.RECORDS]
    assert "patch_sft_forward_names_missing_hook" in [r.name for r in applied]
    targets = {r.name: [guard._resolve(p) for p in r.probes] for r in applied}
    guard._OUTCOMES.clear()  # as `fresh` does: every outcome of this process forgotten
    compat.apply()
    assert {r.name: [guard._resolve(p) for p in r.probes] for r in applied} == targets
