"""The config that really trains: ``--cfg-options`` are merged after the start-up ran.

``xtuner train`` runs ``model_resource`` (the start-up and its fixes) on the config file, then
merges ``--cfg-options``, then builds the runner. Overrides that undo the start-up's fixes are
refused before the first step (``ValidatedRoPEHook`` re-checks ``runner.cfg``), and the doctor
reports them the same way. Stock configs as a user gets them (``xtuner copy-cfg``), real
``xtuner train`` and real ``xtuner-rope doctor``.
"""

import subprocess
import sys

import pytest
import stock_configs as sc
import torch
from mmengine.config import Config
from opt_in import again
from xtuner.dataset.collate_fns import default_collate_fn
from xtuner.dataset.utils import Packer

from xtuner_rope.batch.checks import row_boundaries
from xtuner_rope.config.fields import packing_source
from xtuner_rope.hooks.isolation import refuse_unbounded_packing

FULL = "internlm2_chat_1_8b_full_alpaca_e3"
SHORT_RUN = ("train_cfg.max_epochs=None", "train_cfg.max_iters=4", "randomness.seed=0")
DATASET_OFF = "train_dataloader.dataset.use_varlen_attn=False"
COLLATE_OFF = "train_dataloader.collate_fn.use_varlen_attn=False"
OVERRIDDEN = {
    "dataset": "train_dataloader.dataset.use_varlen_attn: the start-up's fix (set to True: "
    "XTuner's Packer records the boundaries (same packs)) was overridden after it ran "
    "(--cfg-options are merged after model_resource): process_hf_dataset("
    "pack_to_max_length=True) joins dialogues without recording where each starts",
    "collate": "train_dataloader.collate_fn.use_varlen_attn: the start-up's fix (set to True: "
    "it keeps cumulative_len/position_ids (batch size 1)) was overridden after it ran",
}
EDIT = "make it so in the config file or in the --cfg-options"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def full_config(tmp_path_factory):
    """XTuner's stock full fine-tune config, localized, with the README's one edit."""
    root = tmp_path_factory.mktemp("overrides")
    sc.ensure_tiny_model()
    text = sc.localize(sc.copy_stock(FULL, root), sc.write_alpaca_data(root / "alpaca"))
    path = root / f"{FULL}.py"
    path.write_text(sc.enable_plugin(text))
    return path


@pytest.mark.parametrize(
    "overrides, undone",
    [
        # Was a raw KeyError: 'cumulative_len' in XTuner's collate. Opt-in: recheck_config finds
        # each undone fix on its own (one loop over the findings), so the second case's run
        # refuses the dataset override before the first step with this same message, and
        # test_doctor_applies_overrides_in_xtuner_trains_order[overrides0] finds this override
        # alone through the same recheck_config. About 25 s less in CI.
        pytest.param(
            (DATASET_OFF,),
            ["dataset"],
            marks=again(
                "the (DATASET_OFF, COLLATE_OFF) case and "
                "test_doctor_applies_overrides_in_xtuner_trains_order[overrides0]"
            ),
        ),
        ((DATASET_OFF, COLLATE_OFF), ["dataset", "collate"]),  # trained with leaking attention
    ],
)
def test_overridden_fix_is_refused_before_the_first_step(full_config, tmp_path, overrides, undone):
    work_dir = tmp_path / "run"
    proc = sc.xtuner_train(full_config, work_dir, *SHORT_RUN, *overrides)
    out = proc.stdout + proc.stderr
    assert "xtuner-rope: train_dataloader.dataset.use_varlen_attn: process_hf_dataset" in out
    assert (
        f"ConfigConflict: ValidatedRoPEHook: checked again before the first step, on the "
        f"config that really trains: xtuner-rope: {len(undone)} setting(s) of this config "
        "would make training fail or silently wrong"
    ) in out
    for which in undone:
        assert OVERRIDDEN[which] in out, which
    assert EDIT in out
    assert "KeyError" not in out and "Iter(train)" not in out
    assert not list(work_dir.glob("**/*.pth"))


@pytest.mark.parametrize("overrides", [(DATASET_OFF,), (DATASET_OFF, COLLATE_OFF)])
def test_doctor_applies_overrides_in_xtuner_trains_order(full_config, tmp_path, overrides):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "xtuner_rope.cli",
            "doctor",
            str(full_config),
            "--batches",
            "2",
            "--out",
            str(tmp_path / "doctor"),
            "--cfg-options",
            *overrides,
        ],
        cwd=sc.REPO,
        env=sc.venv_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "start-up fix train_dataloader.dataset.use_varlen_attn" in proc.stdout
    assert f"PROBLEM      conflict: {OVERRIDDEN['dataset']}" in proc.stdout
    assert (OVERRIDDEN["collate"] in proc.stdout) == (COLLATE_OFF in overrides)


def _xtuner_packed_batch(use_varlen_attn: bool) -> dict:
    """One row of XTuner's Packer over three dialogues, through XTuner's default_collate_fn."""
    docs = {
        "input_ids": [[1, 5, 6, 2], [1, 7, 8, 9, 2], [1, 4, 2]],
        "labels": [[-100, 5, 6, 2], [-100, -100, 8, 9, 2], [-100, 4, 2]],
    }
    packed = Packer(12, use_varlen_attn=use_varlen_attn)(docs)
    row = {k: v[0] for k, v in packed.items()}
    return default_collate_fn([row], use_varlen_attn=use_varlen_attn)["data"]


def test_packed_rows_without_boundaries_stop_at_the_first_batch(full_config):
    cfg = Config.fromfile(str(full_config))
    packed_by = packing_source(cfg)
    assert packed_by == ("train_dataloader.dataset (process_hf_dataset, pack_to_max_length=True)")
    leaky = _xtuner_packed_batch(use_varlen_attn=False)
    assert leaky["position_ids"].tolist() == [list(range(12))]  # one range over 3 dialogues
    with pytest.raises(
        ValueError,
        match=r"rows of this batch are packed \(train_dataloader\."
        r"dataset \(process_hf_dataset, pack_to_max_length=True\)\) but reach the "
        r"model without document boundaries.*use_varlen_attn=True",
    ):
        refuse_unbounded_packing(leaky, [], packed_by)
    refuse_unbounded_packing(leaky, [], None)  # a config that does not pack: plain rows
    bounded = _xtuner_packed_batch(use_varlen_attn=True)
    refuse_unbounded_packing(bounded, row_boundaries(bounded, 1), packed_by)
    bounded.pop("cumulative_len")  # position resets alone still mark the documents
    refuse_unbounded_packing(bounded, [], packed_by)
    assert torch.equal(bounded["position_ids"][0, :4], torch.arange(4))
