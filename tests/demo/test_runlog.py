"""Judging an `xtuner train` run by its outputs."""

import json

import pytest

from xtuner_rope.demo.runlog import check_run


def _run(tmp_path, losses, checkpoint=True):
    vis = tmp_path / "20260101_000000" / "vis_data"
    vis.mkdir(parents=True)
    (vis.parent / "20260101_000000.log").write_text("log")
    lines = [
        json.dumps({"loss": loss, "iter": 10 * (i + 1), "lr": 1e-3})
        for i, loss in enumerate(losses)
    ]
    (vis / "scalars.json").write_text("\n".join(lines) + "\n")
    if checkpoint:
        ckpt = tmp_path / f"iter_{10 * len(losses)}.pth"
        ckpt.write_bytes(b"x")
        (tmp_path / "last_checkpoint").write_text(str(ckpt))


def test_summary_of_a_good_run(tmp_path):
    _run(tmp_path, [5.0, 4.0, 3.5])
    run = check_run(tmp_path, min_iters=30)
    assert run.iters == [10, 20, 30] and run.losses == [5.0, 4.0, 3.5]
    assert run.checkpoint.name == "iter_30.pth"


@pytest.mark.parametrize(
    "losses, checkpoint, match",
    [
        ([], True, "crashed or never started"),
        ([5.0], True, "crashed or never started"),
        ([5.0, float("nan"), 3.0], True, "non-finite"),
        ([5.0, 4.0, 3.0], False, "no checkpoint"),
    ],
)
def test_failed_runs_are_reported(tmp_path, losses, checkpoint, match):
    _run(tmp_path, losses, checkpoint)
    with pytest.raises(RuntimeError, match=match):
        check_run(tmp_path, min_iters=30)
