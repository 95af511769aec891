"""``xtuner-rope train``: XTuner's ``xtuner train``, with the exit status of the training.

``xtuner train`` exits 0 whatever its child returned; :func:`run_xtuner_train` starts the same
child by the same rule, passes SIGINT/SIGTERM on, and returns its status.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess

from . import xtuner_parsers

TRAIN_MODULE = "xtuner.tools.train"
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def train_script() -> str:
    """Path of XTuner's ``xtuner/tools/train.py``, found without importing XTuner."""
    return xtuner_parsers.tool_script(TRAIN_MODULE)


def _slurm(argv: list[str]) -> bool:
    """``--launcher slurm`` among the arguments (XTuner looks at the first ``--launcher``)."""
    if "--launcher" not in argv:
        return False
    i = argv.index("--launcher")
    return argv[i + 1 : i + 2] == ["slurm"]


def train_command(argv: list[str]) -> list[str]:
    """The child's command line ``xtuner train ARGV`` runs, by XTuner 0.2.0's rule
    (``NNODES``, ``NPROC_PER_NODE``, ``NODE_RANK``, ``ADDR``, ``PORT`` from the environment).

    Raises:
        ValueError: ``NNODES`` or ``NPROC_PER_NODE`` is not an integer.
    """
    env = os.environ
    script = train_script()
    try:
        nnodes = int(env.get("NNODES", 1))
        nproc = int(env.get("NPROC_PER_NODE", 1))
    except ValueError as err:
        raise ValueError(
            f"xtuner-rope train: NNODES={env.get('NNODES')!r} / "
            f"NPROC_PER_NODE={env.get('NPROC_PER_NODE')!r}: expected integers ({err}); "
            "unset them for one process, or set e.g. NPROC_PER_NODE=2"
        ) from None
    if _slurm(argv) or (nnodes == 1 and nproc == 1):
        return ["python", script, *argv]
    port = env.get("PORT")
    if port is None:
        port = str(random.randint(20000, 29999))
        print(f"xtuner-rope train: use random port: {port}", flush=True)
    return [
        "torchrun",
        f"--nnodes={nnodes}",
        f"--node_rank={env.get('NODE_RANK', 0)}",
        f"--nproc_per_node={nproc}",
        f"--master_addr={env.get('ADDR', '127.0.0.1')}",
        f"--master_port={port}",
        script,
        *argv,
        "--launcher",
        "pytorch",
    ]


def parser_answer(argv: list[str], script: str | None = None) -> int | None:
    """What XTuner's ``train.py`` (``script``) answers to ``argv``: 0 (help), 2 (usage), None."""
    return xtuner_parsers.parser_answer(script or train_script(), argv)


def run_xtuner_train(argv: list[str]) -> int:
    """Run ``xtuner train ARGV`` as XTuner does and return the training's exit status.

    Returns:
        The child's status (``128 + N`` when signal N killed it); 2 when it cannot start;
        XTuner's own answer to ``-h`` or a usage error.
    """
    try:
        command = train_command(argv)
        answered = parser_answer(argv)  # `-h`, a usage error: no child, no torch import
        if answered is not None:
            return answered
        child = subprocess.Popen(command)
    except (ValueError, ModuleNotFoundError, OSError) as err:
        print(f"xtuner-rope train: {err}", flush=True)
        return 2

    def forward(signum, _frame) -> None:
        child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED_SIGNALS}
    try:
        code = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 128 - code if code < 0 else code


__all__ = ["parser_answer", "run_xtuner_train", "train_command", "train_script"]
