"""The tiny recipe (configs/tiny_internlm2_short_dialogues.py) run through the real `xtuner train`.

`xtuner train` exits 0 even when training crashes: judge its runs by what they produced
(xtuner_rope.demo.runlog.check_run), not by the return code; `xtuner-rope train` returns it.
"""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "tiny_internlm2_short_dialogues.py"
SHORT_RUN = (
    "train_cfg.max_epochs=None",
    "train_cfg.max_iters=30",
    "default_hooks.logger.interval=5",
    "default_hooks.checkpoint.interval=30",
)


def xtuner_train(
    work_dir: Path, *cfg_options: str, config: Path = CONFIG, command: str = "xtuner"
) -> subprocess.CompletedProcess:
    """Run `xtuner train` (or `xtuner-rope train`: ``command="xtuner-rope"``, which returns the
    training's status) on the tiny recipe from the repository root, as a user would."""
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    cmd = [command, "train", str(config), "--work-dir", str(work_dir)]
    if cfg_options:
        cmd += ["--cfg-options", *cfg_options]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


def load_config(path: str, cfg_options: dict | None = None):
    """``Config.fromfile`` plus ``--cfg-options`` overrides (no start-up run)."""
    from mmengine.config import Config

    cfg = Config.fromfile(path)
    if cfg_options:
        cfg.merge_from_dict(cfg_options)
    return cfg
