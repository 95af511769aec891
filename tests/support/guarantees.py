"""The map from each guarantee to the CI tests that fail when it is turned off, and its checker.

A guarantee is turned off by a *mutation*: one exact piece of the code that provides it
(``old``, which must occur once in ``file``) replaced by code without it (``new``). Its ``tests``
are node ids of fast tests that run in CI (no opt-in variable, no ``slow`` mark) and must each
fail on a scratch copy of the repository with the mutation made. :func:`run_mutation` makes the
copy and runs them; ``tests/test_guarantees.py`` checks the map in CI (every mutation still
applies, every test is collected and fast, and each mutation makes its tests fail);
``python tools/mutations.py`` runs it by hand, and with ``--find FILES`` lists which tests of the
given files a mutation makes fail.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Built, git-ignored resources the tests read: linked into the copy, not rebuilt.
LINKED = ("models", "data/tiny_llava")


@dataclass(frozen=True)
class Guarantee:
    """A promise to users, the code that keeps it, and the CI tests that notice its loss.

    Args:
        name: Short id (``--name`` of tools/mutations.py).
        promise: What users are promised, in a sentence.
        file: Repository-relative path of the code that keeps it.
        old: That code, exactly as in ``file`` (once).
        new: The same place with the guarantee turned off.
        tests: Node ids of fast CI tests that fail with ``new``.
    """

    name: str
    promise: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]


GUARANTEES = (
    Guarantee(
        "whole-packing",
        "Offline packing puts every dialogue whole in one row (no dialogue cut at a row edge).",
        "xtuner_rope/data/packed_dataset.py",
        "packed_tables(table, max_length, use_varlen_attn, whole, mapped, order)",
        "packed_tables(table, max_length, use_varlen_attn, False, mapped, None)",
        (
            "tests/data/test_packed_dataset.py::"
            "test_xtuners_own_pipeline_packs_every_dialogue_whole_and_once",
            "tests/data/test_whole_packing.py::"
            "test_every_dialogue_whole_once_and_rows_as_few_as_bfd[37-90-1]",
        ),
    ),
    Guarantee(
        "rng-restore",
        "A resumed run draws the random numbers the uninterrupted run drew.",
        "xtuner_rope/hooks/random_state.py",
        "def _restore_and_log(state: dict, loop) -> None:\n    restore_random_state(state)",
        "def _restore_and_log(state: dict, loop) -> None:\n    pass",
        (
            "tests/hooks/test_random_state.py::"
            "test_resumed_run_draws_what_the_uninterrupted_run_drew[True]",
            "tests/hooks/test_random_state.py::"
            "test_epoch_loop_resumed_draws_what_the_uninterrupted_run_drew",
        ),
    ),
    Guarantee(
        "atomic-write",
        "A checkpoint is written whole or not at all, even when the writer is killed mid-write.",
        "xtuner_rope/checkpoints/atomic.py",
        'temporary = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}.tmp")',
        "temporary = path",
        (
            "tests/compat/test_checkpoint_kill.py::"
            "test_a_writer_killed_halfway_leaves_no_partial_checkpoint_under_its_name[mmengine]",
            "tests/compat/test_checkpoint_kill.py::"
            "test_a_writer_killed_halfway_leaves_no_partial_checkpoint_under_its_name[deepspeed]",
        ),
    ),
    Guarantee(
        "dialogue-loss",
        "The per-dialogue loss weighs each packed dialogue, not each row, equally.",
        "xtuner_rope/batch/token_counts.py",
        "    if boundaries is not None:\n        first = 0",
        "    if False:\n        first = 0",
        (
            "tests/hooks/test_loss_norm_dialogue.py::"
            "test_dialogue_weights_of_a_packed_row_and_of_rows",
            "tests/hooks/test_loss_norm_dialogue.py::"
            "test_one_step_per_dialogue_whatever_the_grouping",
        ),
    ),
    Guarantee(
        "token-weighted-step",
        "The optimizer step weighs every supervised token equally, however tokens are grouped.",
        "xtuner_rope/hooks/loss_norm.py",
        "        return count\n\n    def _total(self)",
        "        return 1.0\n\n    def _total(self)",
        ("tests/hooks/test_loss_norm.py::test_accumulation_with_a_last_incomplete_window[token]",),
    ),
    Guarantee(
        "padded-row-rope",
        "Each padded row gets the length-dependent RoPE frequencies of its own length.",
        "xtuner_rope/models/rope_documents.py",
        '    state = getattr(rotary, "row_mask", None)\n',
        "    return None\n",
        (
            "tests/models/test_rope_per_document.py::test_padded_rows_equal_alone[llama-dynamic-eager]",
            "tests/models/test_rope_per_document.py::test_padded_rows_equal_alone[phi3-longrope-eager]",
            "tests/models/test_rope_padded_batches.py::"
            "test_padded_preference_rows_equal_each_response_alone[internlm2-eager]",
        ),
    ),
    Guarantee(
        "incomplete-checkpoint",
        "An incomplete checkpoint is never resumed from.",
        "xtuner_rope/checkpoints/complete.py",
        "    return Verdict(path, not reason, reason)",
        '    return Verdict(path, True, "")',
        (
            "tests/compat/test_checkpoint_files.py::"
            "test_every_cut_of_a_runner_checkpoint_is_incomplete[zip]",
            "tests/compat/test_checkpoint_files.py::"
            "test_resume_of_a_cut_checkpoint_is_refused_naming_the_complete_one[mmengine-loader]",
            "tests/compat/test_checkpoint_save.py::"
            "test_auto_resume_skips_an_incomplete_newest_checkpoint",
        ),
    ),
)


def by_name(name: str) -> Guarantee:
    """The guarantee called ``name``."""
    for guarantee in GUARANTEES:
        if guarantee.name == name:
            return guarantee
    raise KeyError(f"no guarantee {name!r}; known: {[g.name for g in GUARANTEES]}")


def scratch_copy(dst: Path) -> Path:
    """The repository's tracked files copied to ``dst`` (built resources linked); returns it."""
    files = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True
    ).stdout.split(b"\0")
    for name in filter(None, files):
        src = REPO / os.fsdecode(name)
        if src.is_file():
            (dst / os.fsdecode(name)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / os.fsdecode(name))
    for name in LINKED:
        if (REPO / name).exists() and not (dst / name).exists():
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            (dst / name).symlink_to(REPO / name)
    return dst


def mutate(root: Path, guarantee: Guarantee) -> None:
    """Turn ``guarantee`` off in the copy at ``root`` (its ``old`` must occur exactly once)."""
    path = root / guarantee.file
    text = path.read_text(encoding="utf-8")
    count = text.count(guarantee.old)
    if count != 1:
        raise AssertionError(
            f"guarantee {guarantee.name!r}: its code occurs {count} times in {guarantee.file}, "
            "expected once: update tests/support/guarantees.py with the code as it is now."
        )
    path.write_text(text.replace(guarantee.old, guarantee.new), encoding="utf-8")


def failed_tests(root: Path, tests: list[str], basetemp: Path) -> tuple[set[str], str]:
    """Run ``tests`` (node ids or files) in the copy at ``root``: the failed node ids, the log."""
    env = dict(os.environ, CI="1", PYTHONPATH=str(root))
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider"]
        + [f"--basetemp={basetemp}", *tests],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    out = proc.stdout + proc.stderr
    return set(re.findall(r"^FAILED (\S+)", out, flags=re.M)), out


def run_mutation(guarantee: Guarantee, tests: list[str] | None = None) -> tuple[set[str], str]:
    """The tests (default: the guarantee's own) that fail with ``guarantee`` turned off."""
    with tempfile.TemporaryDirectory(prefix=f"mutation-{guarantee.name}-") as tmp:
        root = scratch_copy(Path(tmp) / "repo")
        mutate(root, guarantee)
        return failed_tests(root, list(tests or guarantee.tests), Path(tmp) / "pytest")
