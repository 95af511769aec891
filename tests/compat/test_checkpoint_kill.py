"""A process killed halfway through writing a checkpoint leaves no partial file under its name.

The writer is a child Python process with the plugin imported (so the writers training calls are
patched), a real file size limit (``RLIMIT_FSIZE``) of half the checkpoint and ``SIGXFSZ`` at its
default action: the kernel kills the child the moment the file reaches the limit, mid-write, as a
crash or a scheduler's ``SIGKILL`` would, with no ``except``/``finally`` of ours left to run. So
this catches what the full-disk tests cannot (there our cleanup runs and hides a write made in
place): the final name must hold nothing or a complete checkpoint, and the previous checkpoint is
untouched. The writers are the ones training calls: the ``save_checkpoint`` MMEngine's runner
imports and DeepSpeed's ``TorchCheckpointEngine.save``.
"""

from __future__ import annotations

import io
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from xtuner_rope.checkpoints.complete import judge_checkpoint

CHILD = textwrap.dedent(
    """
    import resource, signal, sys
    import torch
    import xtuner_rope
    xtuner_rope.activate()  # applies the checkpoint-write patches, as training does

    writer, path, limit = sys.argv[1], sys.argv[2], int(sys.argv[3])
    state = {"meta": {"iter": 8}, "state_dict": {"w": torch.arange(1 << 18, dtype=torch.float32)}}
    if writer == "mmengine":
        from mmengine.runner import runner  # the name the runner's save_checkpoint calls
        write = lambda: runner.save_checkpoint(state, path)
    else:
        from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import (
            TorchCheckpointEngine,
        )
        engine = TorchCheckpointEngine.__new__(TorchCheckpointEngine)
        engine.zipfile_serialization = True
        write = lambda: engine.save(state, path)
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores it; a crash does not
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    write()
    print("written whole")
    """
)


def _size_of_checkpoint() -> int:
    """Bytes of the child's checkpoint (the same state, serialized here)."""
    state = {"meta": {"iter": 8}, "state_dict": {"w": torch.arange(1 << 18, dtype=torch.float32)}}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.tell()


@pytest.mark.parametrize("writer", ["mmengine", "deepspeed"])
def test_a_writer_killed_halfway_leaves_no_partial_checkpoint_under_its_name(tmp_path, writer):
    previous = tmp_path / "iter_4.pth"
    torch.save({"meta": {"iter": 4}, "state_dict": {"w": torch.zeros(8)}}, previous)
    before = previous.read_bytes()
    target = tmp_path / "iter_8.pth"
    half = _size_of_checkpoint() // 2
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, writer, str(target), str(half)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == -signal.SIGXFSZ, (proc.returncode, proc.stderr[-3000:])
    written = max(p.stat().st_size for p in tmp_path.iterdir() if p != previous)
    assert written == half  # the child really died halfway through the write
    verdict = judge_checkpoint(str(target))
    assert not target.exists() or verdict.complete, verdict.reason  # never half a checkpoint
    assert previous.read_bytes() == before
