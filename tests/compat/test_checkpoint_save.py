"""Checkpoints are written whole or not at all; a full disk stops training with the old ones intact.

A full disk is a real file size limit (``RLIMIT_FSIZE``, with ``SIGXFSZ`` ignored the kernel fails
the write with ``EFBIG`` once the file reaches it, exactly where ``ENOSPC`` would stop a full
disk), set on this very process for the duration of a write and lifted after. The writers under
test are the ones training calls: MMEngine's ``save_checkpoint``, DeepSpeed's
``TorchCheckpointEngine.save`` and a real MMEngine ``Runner`` with its ``CheckpointHook``.
"""

from __future__ import annotations

import contextlib
import resource
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from deepspeed_folders import deepspeed_folder
from mmengine.hooks import Hook
from mmengine.model import BaseModel
from mmengine.runner import Runner
from mmengine.runner import checkpoint as mm_checkpoint
from mmengine.runner.checkpoint import save_checkpoint

from xtuner_rope.checkpoints import auto_resume
from xtuner_rope.checkpoints.atomic import CheckpointWriteError, save_atomically
from xtuner_rope.checkpoints.complete import judge_checkpoint


@contextlib.contextmanager
def file_size_limit(limit: int):
    """No file of this process grows past ``limit`` bytes: writes beyond fail with EFBIG."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


def _checkpoint(n: int) -> dict:
    return {"meta": {"seed": 1, "iter": n}, "state_dict": {"w": torch.randn(n, 256)}}


def test_a_failed_write_leaves_no_file_under_its_name_and_the_previous_intact(tmp_path):
    save_checkpoint(_checkpoint(16), str(tmp_path / "iter_4.pth"))
    before = (tmp_path / "iter_4.pth").read_bytes()
    target = tmp_path / "iter_8.pth"
    with (
        file_size_limit(100_000),
        pytest.raises(
            CheckpointWriteError,
            match=rf"could not write checkpoint {target}: it needs \d+ bytes \(0\.\d MiB\), \d+ "
            rf"bytes free in {tmp_path}; the write failed with \[Errno 27\] File too large\. "
            rf".*newest complete checkpoint is {tmp_path / 'iter_4.pth'}\).* --resume "
            rf"{tmp_path / 'iter_4.pth'}$",
        ),
    ):
        save_checkpoint(_checkpoint(512), str(target))  # ~0.5 MiB
    assert not target.exists()  # MMEngine alone leaves the first 100,000 bytes here
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_4.pth"]  # no temporary left
    assert (tmp_path / "iter_4.pth").read_bytes() == before
    save_checkpoint(_checkpoint(512), str(target))  # room again: written whole
    assert judge_checkpoint(str(target)).complete


def test_deepspeed_rank_files_are_written_whole(tmp_path):
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    save_checkpoint(_checkpoint(16), str(tmp_path / "iter_4.pth"))
    folder = tmp_path / "iter_8.pth"
    folder.mkdir()
    engine, path = TorchCheckpointEngine(), folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    with (
        file_size_limit(100_000),
        pytest.raises(
            CheckpointWriteError, match=rf"File too large.*--resume {tmp_path / 'iter_4.pth'}$"
        ),
    ):
        engine.save(_checkpoint(512), str(path))
    assert not path.exists() and not list(folder.iterdir())
    engine.save(_checkpoint(512), str(path))
    torch.testing.assert_close(engine.load(str(path))["meta"], {"seed": 1, "iter": 512})


class _Linear(BaseModel):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(256, 256)

    def forward(self, inputs, mode="loss"):
        return {"loss": self.layer(torch.stack(inputs)).square().mean()}


class _DiskFullAfter(Hook):
    """From iteration ``at`` on, files stop growing past ``limit`` bytes (a disk that filled up)."""

    def __init__(self, at: int, limit: int, stack: contextlib.ExitStack):
        self.at, self.limit, self.stack = at, limit, stack

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
        if runner.iter + 1 == self.at:
            self.stack.enter_context(file_size_limit(self.limit))


def test_a_full_disk_at_a_checkpoint_stops_training_and_keeps_the_previous_one(tmp_path):
    """``max_keep_ckpts=1``: MMEngine deletes iter_2.pth before writing iter_4.pth, so a failed
    write would leave no checkpoint at all; now the old one goes only once the new is complete."""
    data = [torch.randn(256) for _ in range(8)]
    with contextlib.ExitStack() as stack:
        runner = Runner(
            model=_Linear(),
            work_dir=str(tmp_path),
            train_dataloader=dict(
                dataset=data,
                sampler=dict(type="DefaultSampler", shuffle=False),
                batch_size=1,
                collate_fn=lambda batch: {"inputs": batch},
            ),
            optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.01, momentum=0.9)),
            train_cfg=dict(by_epoch=False, max_iters=8),
            default_hooks=dict(
                checkpoint=dict(type="CheckpointHook", interval=2, by_epoch=False, max_keep_ckpts=1)
            ),
            custom_hooks=[_DiskFullAfter(3, 200_000, stack)],  # checkpoints are ~0.5 MiB
        )
        with pytest.raises(CheckpointWriteError, match=r"iter_4\.pth: it needs \d+ bytes"):
            runner.train()
    kept = tmp_path / "iter_2.pth"
    assert judge_checkpoint(str(kept)).complete and not (tmp_path / "iter_4.pth").exists()
    assert (tmp_path / "last_checkpoint").read_text() == str(kept)
    assert mm_checkpoint.find_latest_checkpoint(str(tmp_path)) == str(kept)


def test_auto_resume_skips_an_incomplete_newest_checkpoint(tmp_path):
    """MMEngine's finder (``resume = True`` without ``load_from``), as the runners call it."""
    for n in (2, 4):
        save_checkpoint(_checkpoint(n), str(tmp_path / f"iter_{n}.pth"))
    newest = tmp_path / "iter_4.pth"
    newest.write_bytes(newest.read_bytes()[:100])
    (tmp_path / "last_checkpoint").write_text(str(newest))
    assert mm_checkpoint.find_latest_checkpoint(str(tmp_path)) == str(tmp_path / "iter_2.pth")
    (tmp_path / "last_checkpoint").write_text(str(tmp_path / "it"))  # the pointer cut short
    assert mm_checkpoint.find_latest_checkpoint(str(tmp_path)) == str(tmp_path / "iter_2.pth")
    (tmp_path / "iter_2.pth").unlink()
    assert (
        mm_checkpoint.find_latest_checkpoint(str(tmp_path)) is None
    )  # nothing complete: a fresh start
    (tmp_path / "last_checkpoint").unlink()
    assert (
        mm_checkpoint.find_latest_checkpoint(str(tmp_path)) is None
    )  # MMEngine's: nothing to resume


def test_auto_resume_names_a_newer_incomplete_deepspeed_folder_it_skips(tmp_path, monkeypatch):
    """Killed while DeepSpeed wrote ``iter_8.pth/`` (rank 1's optimizer file never landed),
    ``last_checkpoint`` still names ``iter_4.pth/``: resumed from there, with a warning that
    names the skipped folder and what it lacks."""
    warned = []
    monkeypatch.setattr(auto_resume, "print_log", lambda msg, **kw: warned.append(msg))
    monkeypatch.setenv("WORLD_SIZE", "2")  # as the two ranks that resume it see
    deepspeed_folder(tmp_path / "iter_4.pth", 2, [0, 1])
    deepspeed_folder(tmp_path / "iter_8.pth", 2, [0])
    (tmp_path / "last_checkpoint").write_text(str(tmp_path / "iter_4.pth"))
    assert mm_checkpoint.find_latest_checkpoint(str(tmp_path)) == str(tmp_path / "iter_4.pth")
    (message,) = warned
    assert f"skipped {tmp_path / 'iter_8.pth'}, newer than {tmp_path / 'iter_4.pth'}" in message
    assert "optim states of data-parallel rank(s) [1] missing" in message
    deepspeed_folder(tmp_path / "iter_12.pth", 2, [0, 1])  # complete but not named: not judged
    warned.clear()
    (tmp_path / "iter_8.pth" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").rename(
        tmp_path / "iter_8.pth" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    )
    assert mm_checkpoint.find_latest_checkpoint(str(tmp_path)) == str(tmp_path / "iter_4.pth")
    assert len(warned) == 1 and "iter_8.pth" in warned[0]  # rank 0's missing now


def test_a_killed_writers_temporary_is_removed_when_the_checkpoint_is_written_again(tmp_path):
    stale = tmp_path / ".iter_8.pth.999999.tmp"  # what a writer killed mid-write leaves
    stale.write_bytes(b"PK\x03\x04 half")
    other = tmp_path / ".iter_4.pth.999999.tmp"  # another checkpoint's: not this write's to judge
    other.write_bytes(b"x")
    save_atomically({"w": torch.ones(2)}, str(tmp_path / "iter_8.pth"))
    assert judge_checkpoint(str(tmp_path / "iter_8.pth")).complete
    assert not stale.exists() and other.exists()


STATE_BYTES = 300 * 2**20  # a DeepSpeed rank's state of a few hundred MB
PEAK_CHILD = textwrap.dedent(
    """
    import sys

    import torch
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    variant, path, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if variant == "patched":
        from xtuner_rope.compat.runner_checkpoints import patch_deepspeed_checkpoint_writes

        assert patch_deepspeed_checkpoint_writes()
    save = TorchCheckpointEngine.save
    assert save.__module__.startswith("xtuner_rope" if variant == "patched" else "deepspeed"), save
    state = {f"w{i}": torch.ones(size // 16) for i in range(4)}  # float32: 4 x size / 4 bytes


    def status(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


    engine = TorchCheckpointEngine()
    for zipfile in (False, True):  # DeepSpeed's default without a config, and its config's
        try:  # the peak (VmHWM) back to the resident size now: earlier peaks forgotten
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:  # an older kernel: the peak so far stays the baseline
            pass
        before = status("VmHWM:")
        engine.zipfile_serialization = zipfile
        engine.save(state, f"{path}.{'zip' if zipfile else 'legacy'}")
        print(status("VmHWM:") - before)
    """
)


def test_a_patched_deepspeed_save_takes_no_more_memory_than_deepspeed_own(tmp_path):
    """Peak resident size while one rank's state (300 MiB) is saved, in torch's legacy format
    (DeepSpeed's without a config) and its zip format, each writer in a fresh process: the
    crash-safe write streams to its temporary file as DeepSpeed's ``torch.save`` to its path
    does. A bytes copy of the state before writing (the write before) raises the peak by the
    state's size."""
    runs = {
        variant: subprocess.Popen(
            [sys.executable, "-c", PEAK_CHILD, variant, str(tmp_path / variant), str(STATE_BYTES)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for variant in ("own", "patched")
    }
    rise = {}
    for variant, proc in runs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        rise[variant] = [int(v) for v in out.split()[-2:]]  # legacy format, zip format
    for own, patched in zip(rise["own"], rise["patched"]):
        assert patched <= own + 0.05 * STATE_BYTES, {
            k: [v >> 20 for v in r] for k, r in rise.items()
        }
    written = sorted(p.name for p in tmp_path.iterdir())  # no temporary left
    assert written == ["own.legacy", "own.zip", "patched.legacy", "patched.zip"], written
    for name in written:
        assert judge_checkpoint(str(tmp_path / name)).complete, name
