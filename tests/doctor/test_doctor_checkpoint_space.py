"""The doctor's checkpoint size and free space, against real checkpoints (no training run).

The estimate is compared with the size of a checkpoint MMEngine's ``save_checkpoint`` really
writes for the tiny InternLM2 after a real AdamW step, and the LoRA adapter count with peft's own
model built as XTuner builds it; a checkpoint already in the work dir is measured, not estimated.
"""

import os
from pathlib import Path

import pytest
import torch
from mmengine.runner.checkpoint import save_checkpoint
from peft import LoraConfig, get_peft_model
from tiny_recipe import load_config
from xtuner.model.utils import find_all_linear_names

from xtuner_rope.demo.tiny import build_tiny_internlm2
from xtuner_rope.doctor.checkpoint_space import (
    checkpoint_space,
    checkpoint_space_lines,
    checkpoint_space_warnings,
    checkpoints_at_once,
    lora_parameters,
    weight_shapes,
)

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny_internlm2_short_dialogues.py"


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    """A tiny InternLM2 saved as a Hugging Face checkpoint (safetensors), and the model."""
    model = build_tiny_internlm2(256, seed=0)
    folder = tmp_path_factory.mktemp("tiny-hf")
    model.save_pretrained(folder, safe_serialization=True)
    return folder, model


def tiny_config(checkpoint: Path, **options):
    options = {"model.llm.pretrained_model_name_or_path": str(checkpoint), **options}
    return load_config(str(TINY), options)


def real_runner_checkpoint(model, cfg, path: Path) -> int:
    """Write what MMEngine's Runner saves (meta with the config, weights, optimizer after a
    real step) with MMEngine's own ``save_checkpoint``; its size in bytes."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.arange(16)[None]).logits.float().mean().backward()
    optimizer.step()
    checkpoint = {
        "meta": {"cfg": cfg.pretty_text, "seed": 0, "epoch": 0, "iter": 4},
        "state_dict": {f"llm.{k}": v for k, v in model.state_dict().items()},
        "optimizer": optimizer.state_dict(),
    }
    save_checkpoint(checkpoint, str(path))
    return path.stat().st_size


def test_the_estimate_is_within_3_percent_of_a_real_checkpoint(hf_checkpoint, tmp_path):
    folder, model = hf_checkpoint
    cfg = tiny_config(folder)
    real = real_runner_checkpoint(model, cfg, tmp_path / "iter_4.pth")
    figures = checkpoint_space(cfg, 2400, 16, str(tmp_path / "empty_work_dir"))
    parameters = sum(p.numel() for p in model.parameters())
    assert f"{parameters:,} saved parameters (all of {parameters:,})" in figures["size_from"]
    assert figures["size_from"].startswith("estimated: ")
    # -1.8% measured: torch.save's per-tensor zip records (~250 bytes each), not estimated,
    # weigh on a 107k-parameter model only
    assert abs(figures["checkpoint_bytes"] - real) / real < 0.03, (figures, real)


def test_a_checkpoint_in_the_work_dir_is_measured_and_a_cut_newer_one_skipped(
    hf_checkpoint, tmp_path
):
    folder, model = hf_checkpoint
    cfg = tiny_config(folder)
    real = real_runner_checkpoint(model, cfg, tmp_path / "iter_4.pth")
    (tmp_path / "iter_8.pth").write_bytes((tmp_path / "iter_4.pth").read_bytes()[: real // 2])
    figures = checkpoint_space(cfg, 2400, 16, str(tmp_path))
    assert figures["size_from"] == f"measured: {tmp_path / 'iter_4.pth'}"
    assert figures["checkpoint_bytes"] == real
    # 150 iterations, a save every 100 and the last: 2 saves, max_keep_ckpts = 1 -> 2 at once
    assert figures["at_once"] == 2 and figures["needed_bytes"] == 2 * real
    assert figures["free_bytes"] > 0 and figures["filesystem"] == str(tmp_path)
    assert checkpoint_space_warnings(figures) == []  # a few MiB fit
    assert checkpoint_space_lines(figures)[0].startswith(
        f"checkpoints  {real / 2**20:,.1f} MiB each (measured: "
    )


@pytest.mark.parametrize("targets", [None, ["wqkv"], ["wqkv", "w2", "output"]])
def test_the_lora_adapter_count_equals_peft_as_xtuner_builds_it(hf_checkpoint, targets):
    folder, _ = hf_checkpoint
    model = build_tiny_internlm2(256, seed=0)
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, bias="none", task_type="CAUSAL_LM")
    lora.target_modules = targets or find_all_linear_names(model)  # SupervisedFinetune's rule
    peft = get_peft_model(model, lora)
    trainable = sum(p.numel() for p in peft.parameters() if p.requires_grad)
    shapes = weight_shapes(folder)
    assert lora_parameters(shapes, {"r": 4, "target_modules": targets}) == trainable


def test_a_lora_config_is_estimated_from_its_adapter(hf_checkpoint, tmp_path):
    folder, _ = hf_checkpoint
    lora = dict(type="peft.LoraConfig", r=4, target_modules=["wqkv"])
    cfg = tiny_config(folder, **{"model.lora": lora})
    figures = checkpoint_space(cfg, 2400, 16, str(tmp_path))
    adapter = lora_parameters(weight_shapes(folder), {"r": 4, "target_modules": ["wqkv"]})
    assert f"{adapter:,} saved parameters (LoRA adapter of " in figures["size_from"]
    assert figures["checkpoint_bytes"] == adapter * 4 * 3 + len(cfg.pretty_text.encode())


@pytest.mark.parametrize(
    "hook,iterations,epochs,expected",
    [
        (dict(interval=100, by_epoch=False, max_keep_ckpts=1), 150, 1, 2),  # tiny recipe
        (dict(interval=100, by_epoch=False, max_keep_ckpts=1, save_last=False), 150, 1, 1),
        (dict(interval=50, by_epoch=False, max_keep_ckpts=2), 150, 1, 3),  # 3 saves, 2 + 1
        (dict(interval=50, by_epoch=False, max_keep_ckpts=-1), 150, 1, 3),  # keep every one
        (dict(interval=7, by_epoch=False), 150, 1, 22),  # 21 saves + the last, kept all
        (dict(interval=1, by_epoch=True, max_keep_ckpts=2), 450, 3, 3),  # per epoch
        (dict(interval=-1, by_epoch=False), 150, 1, 0),  # no checkpoint at all
    ],
)
def test_checkpoints_at_once(hook, iterations, epochs, expected):
    assert checkpoints_at_once(hook, iterations, epochs) == expected


def test_keeping_every_checkpoint_of_a_long_run_is_warned_with_the_figures(hf_checkpoint, tmp_path):
    folder, _ = hf_checkpoint
    cfg = tiny_config(
        folder,
        **{
            "default_hooks.checkpoint.interval": 1,
            "default_hooks.checkpoint.max_keep_ckpts": -1,
            "train_cfg.max_epochs": 10**8,  # 1.5e10 checkpoints of 1.2 MiB: no disk holds them
        },
    )
    figures = checkpoint_space(cfg, 2400, 16, str(tmp_path / "not" / "yet"))
    assert figures["at_once"] == 150 * 10**8
    assert figures["filesystem"] == str(tmp_path)  # the folder that exists: its free space
    (warning,) = checkpoint_space_warnings(figures)
    size = f"{figures['checkpoint_bytes'] / 2**20:,.1f} MiB"
    assert warning.startswith(f"checkpoints: 15,000,000,000 checkpoints of {size} (estimated: ")
    assert f" TiB at once in {tmp_path / 'not' / 'yet'} (every checkpoint kept), but " in warning
    assert f"but {tmp_path} has " in warning and "lower max_keep_ckpts" in warning


def test_weights_not_on_this_machine_leave_the_size_unknown(tmp_path):
    cfg = tiny_config(tmp_path / "no-such-checkpoint")
    figures = checkpoint_space(cfg, 2400, 16, str(tmp_path))
    assert figures["checkpoint_bytes"] is None and figures["needed_bytes"] is None
    assert "no weight files of" in figures["size_from"]
    assert checkpoint_space_warnings(figures) == []
    assert checkpoint_space_lines(figures) == [
        f"checkpoints  size unknown (no weight files of "
        f"{str(tmp_path / 'no-such-checkpoint')!r} on this machine to count its parameters)"
    ]


def test_the_default_work_dir_is_xtuner_trains(hf_checkpoint, tmp_path, monkeypatch):
    from xtuner_rope.doctor.checkpoint_space import run_work_dir

    cfg = tiny_config(hf_checkpoint[0])
    assert run_work_dir(cfg, str(TINY)) == os.path.join(
        "./work_dirs", "tiny_internlm2_short_dialogues"
    )
    assert run_work_dir(cfg, str(TINY), str(tmp_path)) == str(tmp_path)
    cfg.work_dir = "elsewhere"
    assert run_work_dir(cfg, str(TINY)) == "elsewhere"
