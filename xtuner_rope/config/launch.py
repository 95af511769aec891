"""How the run is launched: DeepSpeed dtypes on a CPU-only machine, samplers that need DeepSpeed.

Refused at start-up, with the edit: DeepSpeed fp16/bf16 enabled on a CPU-only machine
(``strategy.config`` or ``--deepspeed``), and ``InternRepoSampler`` on several processes
without DeepSpeed.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import sys
from pathlib import Path

from mmengine.config import Config

from xtuner_rope.checkpoints.world import current_world_size
from xtuner_rope.compat.devices import cpu_only
from xtuner_rope.compat.mmengine_config import config_dict

from .fields import type_name
from .findings import Finding
from .startup import register_findings

# The project's fp32 DeepSpeed settings for CPU runs, by ZeRO stage.
FP32_CPU_JSON = {
    2: "configs/deepspeed/zero2_fp32_cpu.json",
    3: "configs/deepspeed/zero3_fp32_cpu.json",
}
REPO = Path(__file__).resolve().parents[2]  # the checkout (xtuner_rope/config/../..)
# Samplers that take their rank and world size from DeepSpeed's data-parallel group.
DEEPSPEED_SAMPLERS = ("InternRepoSampler",)


# ``--deepspeed`` of a run that is not this process: ``xtuner-rope doctor --deepspeed X`` sets it
# (see :func:`launched_with`) so the start-up's findings are those of ``xtuner train --deepspeed X``.
_LAUNCH: dict = {}


@contextlib.contextmanager
def launched_with(deepspeed: str | None):
    """Inspect configs as if ``xtuner train ... --deepspeed deepspeed`` had started them (a json or
    one of XTuner's names; None changes nothing).
    """
    saved = dict(_LAUNCH)
    if deepspeed:
        _LAUNCH["deepspeed"] = deepspeed
    try:
        yield
    finally:
        _LAUNCH.clear()
        _LAUNCH.update(saved)


def deepspeed_argument(argv: list[str] | None = None) -> str | None:
    """``--deepspeed``'s value when this process is ``xtuner train`` (``argv`` default ``sys.argv``,
    then the doctor's :func:`launched_with` comes first), or None.
    """
    if argv is None and _LAUNCH.get("deepspeed"):
        return _LAUNCH["deepspeed"]
    argv = sys.argv if argv is None else argv
    if not argv or not Path(argv[0]).as_posix().endswith("xtuner/tools/train.py"):
        return None
    for i, arg in enumerate(argv):
        if arg == "--deepspeed" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--deepspeed="):
            return arg.split("=", 1)[1]
    return None


def _resolve(source: object) -> tuple[dict | None, str]:
    """A DeepSpeed config (dict, file, or XTuner name) as a dict, and how to name it."""
    if isinstance(source, dict):
        return copy.deepcopy(dict(source)), "strategy.config"
    if not isinstance(source, str):
        return None, ""
    path = source
    if not os.path.isfile(path):
        from xtuner.configs import cfgs_name_path

        path = cfgs_name_path.get(source)
        if path is None:  # xtuner train raises its own FileNotFoundError
            return None, ""
    return json.loads(Path(path).read_text(encoding="utf-8")), f"{source} ({path})"


def _deepspeed_source(cfg: Config, argv: list[str] | None) -> tuple[object, str]:
    """Where the run's DeepSpeed config comes from: the config's strategy or ``--deepspeed``."""
    optim = dict.get(config_dict(cfg), "optim_wrapper")
    strategy = dict.get(config_dict(cfg), "strategy")
    if isinstance(strategy, dict) and type_name(strategy.get("type")).endswith("DeepSpeedStrategy"):
        return strategy.get("config"), "strategy.config"
    if isinstance(optim, dict) and type_name(optim.get("type")) == "DeepSpeedOptimWrapper":
        return None, ""  # xtuner train keeps such a config's own strategy
    arg = deepspeed_argument(argv)
    return (arg, "--deepspeed") if arg else (None, "")


def resolved_dtype(ds: dict) -> str | None:
    """``fp16``/``bf16`` as XTuner resolves the DeepSpeed config on this machine, else None: its
    own ``auto_dtype_of_deepspeed_config`` (as ``xtuner train`` runs it) on a copy."""
    from xtuner.tools.utils import auto_dtype_of_deepspeed_config

    from xtuner_rope.compat import run_patch
    from xtuner_rope.compat.torch_cpu import patch_torch_cpu_bf16_query

    run_patch(patch_torch_cpu_bf16_query)  # what the plugin's start-up does before xtuner reads it
    ds = auto_dtype_of_deepspeed_config(copy.deepcopy(ds))
    for key in ("fp16", "bf16"):
        if (ds.get(key) or {}).get("enabled") is True:
            return key
    return None


def _fp32_json(stage: int) -> str:
    """The project's fp32 CPU DeepSpeed json for ``stage`` (absolute in a checkout)."""
    rel = FP32_CPU_JSON.get(stage, FP32_CPU_JSON[2])
    return str(REPO / rel) if (REPO / rel).is_file() else rel


def deepspeed_dtype_findings(cfg: Config, argv: list[str] | None = None) -> list[Finding]:
    """A DeepSpeed config that resolves to fp16/bf16 on this CPU-only machine: refused (``argv``:
    default ``sys.argv``, read only inside ``xtuner train``).
    """
    if not cpu_only():
        return []
    source, where = _deepspeed_source(cfg, argv)
    ds, name = _resolve(source)
    if ds is None:
        return []
    dtype = resolved_dtype(ds)
    if dtype is None:
        return []
    stage = int((ds.get("zero_optimization") or {}).get("stage", 2))
    fp32 = _fp32_json(stage)
    edit = (
        f"pass --deepspeed {fp32} (xtuner-rope's repository; any json with "
        '"fp16": {"enabled": false}, "bf16": {"enabled": false}) instead'
        if where == "--deepspeed"
        else f'set strategy.config = "{fp32}" (or "fp16"/"bf16" "enabled": false in yours)'
    )
    why = (
        "DeepSpeed raises 'Type fp16 is not supported on your device' when the engine is "
        "built, after the weights are loaded"
        if dtype == "fp16"
        else "bf16 would be emulated, and xtuner-rope's CPU guarantees are measured in fp32"
    )
    return [
        Finding(
            where,
            f"{name} resolves to {dtype} on this CPU-only machine "
            f"(XTuner's auto_dtype_of_deepspeed_config): {why}",
            edit,
        )
    ]


def sampler_findings(
    cfg: Config, argv: list[str] | None = None, world_size: int | None = None
) -> list[Finding]:
    """A sampler that needs DeepSpeed's data-parallel group, on several processes without it
    (``argv`` default ``sys.argv``, ``world_size`` default ``WORLD_SIZE``)."""
    if world_size is None:
        world_size = current_world_size()
    loader = dict.get(config_dict(cfg), "train_dataloader")
    sampler = loader.get("sampler") if isinstance(loader, dict) else None
    name = type_name(sampler.get("type")) if isinstance(sampler, dict) else ""
    needs = next((s for s in DEEPSPEED_SAMPLERS if name.endswith(s)), None)
    if world_size < 2 or needs is None or _deepspeed_source(cfg, argv)[0] is not None:
        return []
    return [
        Finding(
            "train_dataloader.sampler",
            f"{needs} takes its rank from DeepSpeed's data-parallel "
            f"group, which only XTuner's DeepSpeedStrategy sets up; on {world_size} processes "
            "without DeepSpeed the dataloader fails ('data parallel group is not initialized')",
            "run with --deepspeed (deepspeed_zero2 on a GPU, "
            f"{_fp32_json(2)} on CPU), or use sampler=dict(type=DefaultSampler, shuffle=True) "
            "(from mmengine.dataset import DefaultSampler)",
        )
    ]


# What torchrun sets and DeepSpeed's ``init_distributed`` reads; without all of them DeepSpeed
# 0.19.6 looks for MPI (``mpi_discovery``: ``No module named 'mpi4py'`` after the model loaded).
LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _launcher(argv: list[str]) -> str:
    for i, arg in enumerate(argv):
        if arg == "--launcher" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--launcher="):
            return arg.split("=", 1)[1]
    return "none"


def single_process_deepspeed_findings(
    cfg: Config, argv: list[str] | None = None, environ: dict | None = None
) -> list[Finding]:
    """``xtuner train CFG --deepspeed X.json`` in one process without a launcher: a fix giving this
    process a one-process torchrun's variables (a free ``MASTER_PORT``), as DeepSpeed would look
    for MPI once the model is built. Only inside ``xtuner train``; ``argv`` defaults to
    ``sys.argv``, ``environ`` (read and fixed) to ``os.environ``.
    """
    argv = sys.argv if argv is None else argv
    environ = os.environ if environ is None else environ
    if not argv or not Path(argv[0]).as_posix().endswith("xtuner/tools/train.py"):
        return []
    if _launcher(argv) != "none" or _deepspeed_source(cfg, argv)[0] is None:
        return []
    missing = [key for key in LAUNCHER_ENV if key not in environ]
    if not missing:
        return []

    def one_process() -> None:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = str(s.getsockname()[1])
        defaults = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        for key in missing:
            environ[key] = defaults.get(key, port)

    return [
        Finding(
            "--deepspeed without --launcher",
            f"DeepSpeed in one process without {', '.join(missing)}: DeepSpeed would look for "
            "MPI ('No module named mpi4py') after the model is built",
            "set this process's environment as a one-process torchrun would (RANK=0 "
            "LOCAL_RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=<a free port>)",
            one_process,
        )
    ]


@register_findings("launch")
def launch_findings(cfg: Config) -> list[Finding]:
    """Every launch finding of this process's command line and environment."""
    return (
        deepspeed_dtype_findings(cfg)
        + sampler_findings(cfg)
        + single_process_deepspeed_findings(cfg)
    )


def deepspeed_zero_stage(cfg: Config, argv: list[str] | None = None) -> int | None:
    """The ZeRO stage (0-3) of the run's DeepSpeed config, or None (none, or not readable yet);
    ``argv`` as in :func:`deepspeed_dtype_findings`.
    """
    ds, _ = _resolve(_deepspeed_source(cfg, argv)[0])
    if ds is None:
        return None
    return int((ds.get("zero_optimization") or {}).get("stage", 0))
