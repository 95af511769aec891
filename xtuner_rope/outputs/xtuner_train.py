"""``xtuner-rope train``: XTuner's ``xtuner train``, with the exit status of the training.

``xtuner train ARGS`` (xtuner 0.2.0, ``xtuner/entry_point.py``) starts XTuner's
``xtuner/tools/train.py`` in a child process and exits 0 whatever the child returned: a crash,
a start-up refusal of the plugin or a stop by ``NonFiniteTripwireHook`` all look like success
to a script, a scheduler or CI. :func:`run_xtuner_train` starts the very same child, by the
very same rule, and returns its status:

- ``python <train.py> ARGS`` with one node and one process per node (``NNODES``,
  ``NPROC_PER_NODE`` unset or 1), and with ``--launcher slurm`` (srun starts the processes);
- else ``torchrun --nnodes=NNODES --node_rank=NODE_RANK --nproc_per_node=NPROC_PER_NODE
  --master_addr=ADDR --master_port=PORT <train.py> ARGS --launcher pytorch`` (a random port in
  20000-29999 when ``PORT`` is unset, logged as XTuner logs it).

``ARGS`` pass on untouched (``--deepspeed``, ``--cfg-options``, ``--resume``, ``--work-dir``,
``--launcher``, ``-h`` ...); ``python`` and ``torchrun`` are found on ``PATH``, as XTuner finds
them. The child's status is returned: 0 when training finished, non-zero otherwise (``train.py``
exits 1 on any exception; torchrun non-zero when a worker failed). SIGINT and SIGTERM sent to
this process are passed to the child, which then decides; a child killed by a signal gives
``128 + signal``, as a shell reports it.
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


def train_command(argv: list[str], env: dict[str, str] | None = None) -> list[str]:
    """The command ``xtuner train ARGV`` runs, by XTuner 0.2.0's rule (module docstring).

    Args:
        argv: The arguments after ``train``.
        env: The environment to read ``NNODES``, ``NPROC_PER_NODE``, ``NODE_RANK``, ``ADDR``
            and ``PORT`` from (default: this process's).

    Returns:
        The child's command line.

    Raises:
        ValueError: ``NNODES`` or ``NPROC_PER_NODE`` is not an integer (XTuner prints its
            help and exits 0 there).
    """
    env = os.environ if env is None else env
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
    """What XTuner's ``train.py`` answers by itself to ``argv``: its help, or a usage error.

    Args:
        argv: The arguments after ``train``.
        script: XTuner's ``train.py`` (default: :func:`train_script`).

    Returns:
        See :func:`xtuner_rope.outputs.xtuner_parsers.parser_answer`: 0 after the help, 2 on a
        usage error, ``None`` when the child decides.
    """
    return xtuner_parsers.parser_answer(script or train_script(), argv)


def run_xtuner_train(argv: list[str]) -> int:
    """Run ``xtuner train ARGV`` as XTuner does and return the training's exit status.

    Args:
        argv: The arguments after ``train``, exactly as ``xtuner train`` takes them.

    Returns:
        The child's status (``128 + N`` when signal N killed it); 2 when the command cannot
        be built or started (the reason printed); XTuner's own answer to ``-h`` or a usage
        error (:func:`parser_answer`) without starting the child.
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
