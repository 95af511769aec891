"""``llava_collate_fn``'s ``image_tokens`` against the vision tower: refused at start-up.

The doctor and ``xtuner train`` meet the same finding (``config.llava_tower``): the doctor
through the start-up it runs, the run through ``model_resource`` (before any weight loads) or,
for a ``--cfg-options`` override, through ``ValidatedRoPEHook``'s re-check before the first
step. Both ways (too small, too large) are refused with ``Set image_tokens=P``.
"""

import subprocess
import sys
from pathlib import Path

import pytest
from mmengine.config import Config

from xtuner_rope.config.as_xtuner_train import start_file
from xtuner_rope.config.findings import ConfigConflict
from xtuner_rope.config.llava_tower import llava_collate_findings, tower_image_tokens
from xtuner_rope.config.overrides import recheck_config
from xtuner_rope.config.startup import state_kept
from xtuner_rope.demo.resources import tiny_llava
from xtuner_rope.demo.tiny_clip import save_tiny_clip

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "configs" / "tiny_llava_internlm2_short_dialogues.py"
P = 16  # tiny CLIP: (56 // 14) ** 2


@pytest.fixture(scope="module")
def clip(tmp_path_factory) -> Path:
    return save_tiny_clip(tmp_path_factory.mktemp("clip") / "tiny-clip")


def _cfg(clip: Path, image_tokens) -> Config:
    collate = dict(type="llava_collate_fn", max_length=256)
    if image_tokens is not None:
        collate["image_tokens"] = image_tokens
    return Config(
        dict(
            model=dict(
                type="LLaVAModel", visual_encoder=dict(pretrained_model_name_or_path=str(clip))
            ),
            train_dataloader=dict(collate_fn=collate),
        )
    )


@pytest.mark.parametrize("asked", [4, 15, 17, 576, None])
def test_wrong_image_tokens_is_a_conflict_naming_the_value_to_set(clip, asked):
    (finding,) = llava_collate_findings(_cfg(clip, asked))
    assert finding.fix is None and finding.setting == "train_dataloader.collate_fn.image_tokens"
    assert f"{asked!r}, but the vision tower (model.visual_encoder, {clip}) gives 16" in (
        finding.problem
    )
    assert finding.edit == f"set image_tokens={P}"
    small = isinstance(asked, int) and asked < P
    assert ("longer than max_length once expanded" in finding.problem) == small


def test_right_image_tokens_other_collates_and_unreadable_towers_pass(clip, tmp_path):
    assert llava_collate_findings(_cfg(clip, P)) == []
    text = Config(dict(train_dataloader=dict(collate_fn=dict(type="rope_collate_fn"))))
    assert llava_collate_findings(text) == []
    assert llava_collate_findings(_cfg(tmp_path / "no-tower-here", 4)) == []  # judged later
    assert tower_image_tokens(clip)["image_tokens"] == P


def _recipe(tmp_path: Path, image_tokens: int) -> Path:
    """The tiny LLaVA recipe, packed by ``llava_collate_fn(image_tokens=...)``, absolute paths."""
    text = RECIPE.read_text()
    for rel in ("models/tiny-internlm2", "models/tiny-clip", "data/tiny_llava"):
        text = text.replace(f'"{rel}', f'"{REPO}/{rel}')  # run from anywhere
    text = text.replace(
        "collate_fn=dict(type=default_collate_fn)",
        f"collate_fn=dict(type=llava_collate_fn, max_length=256, image_tokens={image_tokens})",
    )
    text = text.replace(
        "from xtuner_rope import tiny_llava\n",
        "from xtuner_rope import tiny_llava\nfrom xtuner_rope import llava_collate_fn\n",
    )
    path = tmp_path / f"tiny_llava_image_tokens_{image_tokens}.py"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def recipe_assets():
    """The recipe's tiny LLM, CLIP and data (built once, as its model_resource does)."""
    with state_kept():
        tiny_llava(
            str(REPO / "models" / "tiny-internlm2"),
            clip_path=str(REPO / "models" / "tiny-clip"),
            data_dir=str(REPO / "data" / "tiny_llava"),
        )


def test_too_large_refused_by_the_start_up_xtuner_train_runs(recipe_assets, tmp_path):
    """The same start as ``xtuner train`` (``as_xtuner_train.start_file``), in this process."""
    with state_kept(), pytest.raises(ConfigConflict, match="-> set image_tokens=16") as e:
        start_file(str(_recipe(tmp_path, 64)))
    assert "train_dataloader.collate_fn.image_tokens: 64, but the vision tower" in str(e.value)


def test_override_on_the_command_line_is_named_by_the_recheck(recipe_assets, tmp_path):
    with state_kept():
        cfg = start_file(str(_recipe(tmp_path, P)), {"train_dataloader.collate_fn.image_tokens": 8})
        (conflict,) = [c for c in recheck_config(cfg) if "image_tokens" in c.setting]
    assert conflict.problem.startswith("set after the start-up ran (--cfg-options): 8, but")
    assert conflict.edit == f"set image_tokens={P}"


@pytest.mark.slow
def test_xtuner_train_refuses_too_small_before_loading(recipe_assets, tmp_path):
    """The real ``xtuner train`` code (``python -m xtuner.tools.train``, which returns 1)."""
    config = _recipe(tmp_path, 4)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "xtuner.tools.train",
            str(config),
            "--work-dir",
            str(tmp_path / "w"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 1, out[-3000:]
    assert "ConfigConflict" in out and "train_dataloader.collate_fn.image_tokens: 4, but the" in out
    assert f"-> set image_tokens={P}" in out
    assert "Iter(train)" not in out and "Loads checkpoint" not in out
