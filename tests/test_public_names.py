"""Names users are told to use work: the README's and the docs', the recipes', every `__all__`.

A name the README has documented is API. `PUBLIC` lists them (today's `__all__` of every module,
the names the README, the docs and the recipes tell users to import, name in a config or run);
the test fails if one disappears. Until the first tagged release a moved or removed name is not
kept as an alias: it is recorded in CHANGELOG.md (old -> new), and the test holds that table to
the package (every old path gone, every new one there).
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PUBLIC = {
    "xtuner_rope": [
        "NonFiniteTripwireHook",
        "PackedBatchCheckHook",
        "PackingMetricsHook",
        "ValidatedRoPEHook",
        "ValidatedRotaryEmbedding",
        "apply_rotary_pos_emb",
        "enable_xtuner_rope",
        "patch_internlm2_attention",
        "rope_collate_fn",
        # issue 39: held-out evaluation
        "TokenLossMetric",
        "HeldOutCurvesHook",
        # issue 59: the tiny recipes' model_resource, read through the package (it activates)
        "tiny_checkpoint",
        "tiny_llava",
    ],
    "xtuner_rope.hooks": [
        "PackedBatchCheckHook",
        "ValidatedRoPEHook",
        # issue 27: the hooks/ folder holds every hook
        "NonFiniteTripwireHook",
        "PackingMetricsHook",
        "TokenWeightedLossHook",
    ],
    "xtuner_rope.batch.items": [
        "Sample",
        "parse_sample",
        "check_id_range",
        "is_supervised",
        "item_error",
        "IGNORE_INDEX",
    ],
    "xtuner_rope.ops.rope": [
        "apply_rotary_pos_emb",
        "check_position_ids",
        "cos_sin",
        "cos_sin_at",
        "inv_freq",
        "rotate_half",
        "use_fused_apply",
    ],
    "xtuner_rope.models.internlm2_rope": ["ValidatedRotaryEmbedding"],
    "xtuner_rope.models.runtime": [
        "VARLEN_HUB",
        "CUMULATIVE_KEY",
        "MAX_SEQLEN_KEY",
        "batch_document_plan",
        "choose_backend",
        "hub_cumulative_len",
    ],
    "xtuner_rope.ops.boundaries": ["check_flat_boundaries"],
    "xtuner_rope.batch.record": ["RECORD_FORMAT", "load_record", "save_record"],
    "xtuner_rope.ops.positions": ["check_position_ids"],
    "xtuner_rope.batch.checks": ["check_packed_batch", "check_flat_boundaries", "row_boundaries"],
    "xtuner_rope.ops.packing": [
        "cumulative_from_lengths",
        "lengths_from_cumulative",
        "position_ids_from_cumulative",
        "cumulative_from_position_ids",
        "segment_starts_from_cumulative",
        "position_ids_from_starts",
        "flat_cumulative",
        "plan_packs",
        "padded_length",
    ],
    "xtuner_rope.batch.stats": ["BatchStats", "batch_stats", "segment_ids"],
    "xtuner_rope.ops.inputs": ["show", "to_int_tensor"],
    "xtuner_rope.models": [
        "HF_ATTENTION_CLASSES",
        "INTERNLM2_ATTENTION_CLASSES",
        "PACKED_ATTENTION_KEY",
        "SUPPORTED_ROPE_TYPES",
        "HFValidatedRotaryEmbedding",
        "integration_for",
        "is_patched_hf_attention",
        "patch_hf_model",
        "patch_internlm2_attention",
    ],
    "xtuner_rope.demo.resources": ["tiny_checkpoint", "tiny_llava"],
    "xtuner_rope.demo.runlog": ["check_run", "train_losses"],
    # Issue 27's layout: the role folders (the old top-level paths are in CHANGELOG.md).
    "xtuner_rope.config.startup": [
        "enable_xtuner_rope",
        "inspect_config",
        "is_prepared",
        "prepare_config",
        "register_findings",
        "require_prepared",
        "state_kept",
    ],
    "xtuner_rope.config.findings": ["ConfigConflict", "Finding", "SLOTS"],
    "xtuner_rope.hooks.monitor": ["NonFiniteError", "NonFiniteTripwireHook", "PackingMetricsHook"],
    "xtuner_rope.data.collate": ["rope_collate_fn", "IGNORE_INDEX", "DEFAULT_PAD_TOKEN_INDEX"],
    "xtuner_rope.data.collate_llava": ["llava_collate_fn"],
    "xtuner_rope.models.dispatch": [
        "isolates_documents",
        "language_model",
        "patch_model",
        "unwrap_model",
    ],
    # Issue 35: `xtuner-rope check` and the captures, by job.
    "xtuner_rope.check": [
        "run_check",
        "format_summary",
        "write_report",
        "KINDS",
        "TOLERANCES",
        "judge",
        "start_config",
        "train_dtype",
        "first_batches",
    ],
    "xtuner_rope.capture.text": ["IsolationCaptureHook", "compare_capture", "CAPTURE_FILE"],
    "xtuner_rope.capture.llava": [
        "LLaVAIsolationCaptureHook",
        "compare_llava_capture",
        "LLAVA_CAPTURE_FILE",
    ],
    "xtuner_rope.capture.preference": [
        "PreferenceCaptureHook",
        "compare_preference_capture",
        "capture_file",
    ],
    "xtuner_rope.outputs.replay": ["build_run_model", "load_record", "replay", "save_record"],
    "xtuner_rope.outputs.xtuner_tools": [
        "XTUNER_TOOLS",
        "resolved_model_options",
        "run_xtuner_tool",
    ],
}
# Commands and scripts the README (today's or earlier) tells users to run.
COMMANDS = ["doctor", "convert", "chat"]
TOOLS = [
    "tools/check_run.py",
    "tools/replay_batch.py",
    "tools/make_sample_data.py",
    "tools/make_preference_data.py",
    "tools/make_tiny_internlm2.py",
    "tools/setup_env.sh",
    "tools/bench/packing.py",
    "tools/bench/rope.py",
    "tools/bench/hook_overhead.py",
    "tools/bench/monitor_overhead.py",
]
# Config `type='Name'` strings resolved through MMEngine's root registries.
REGISTERED = {
    "HOOKS": [
        "ValidatedRoPEHook",
        "PackedBatchCheckHook",
        "PackingMetricsHook",
        "NonFiniteTripwireHook",
    ],
    "FUNCTIONS": ["rope_collate_fn"],
}


def _readme_names() -> set[tuple[str, str]]:
    """(module, name) of every `from xtuner_rope... import A, B` and `xtuner_rope.x.Y` in the
    README and the documentation site's pages (`docs/**/*.md`): names the docs document are API."""
    sources = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    text = "\n".join(path.read_text(encoding="utf-8") for path in sources)
    found = set()
    for module, names in re.findall(r"from (xtuner_rope(?:\.\w+)*) import (\w+(?:, \w+)*)", text):
        found |= {(module, name.strip()) for name in names.split(",") if name.strip()}
    for dotted in re.findall(r"\bxtuner_rope(?:\.\w+)+", text):
        module, _, name = dotted.rpartition(".")
        found.add((module, name))
    return found


def _resolve(module: str, name: str) -> object:
    """``module.name``, where ``name`` may itself be a submodule."""
    try:
        return getattr(importlib.import_module(module), name)
    except AttributeError:
        return importlib.import_module(f"{module}.{name}")


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_public_names_still_import(module):
    mod = importlib.import_module(module)
    missing = [name for name in PUBLIC[module] if not hasattr(mod, name)]
    assert not missing, f"{module} lost public names {missing}: record them in CHANGELOG.md"


def test_every_all_entry_resolves():
    for module in PUBLIC:
        mod = importlib.import_module(module)
        for name in getattr(mod, "__all__", []):
            assert hasattr(mod, name), f"{module}.__all__ names {name}, which is not there"


def test_readme_names_resolve():
    names = _readme_names()
    assert ("xtuner_rope", "enable_xtuner_rope") in names  # the parser sees the one edit
    broken = []
    for module, name in sorted(names):
        try:
            _resolve(module, name)
        except (ImportError, AttributeError) as error:
            broken.append(f"{module}.{name}: {error}")
    assert not broken, broken


def _exit_status(argv: list[str]) -> int:
    from xtuner_rope.cli import main

    try:
        return main(argv)
    except SystemExit as stop:
        return stop.code


def test_commands_tools_and_registry_names(capsys):
    from mmengine import registry

    # `-h` of each command exits 0 (convert/chat pass it to XTuner's tool: its own help).
    assert {command: _exit_status([command, "-h"]) for command in COMMANDS} == dict.fromkeys(
        COMMANDS, 0
    )
    assert _exit_status(["no-such-command"]) == 2
    assert "--prompt-template" in capsys.readouterr().out  # XTuner's chat help came through
    assert not [path for path in TOOLS if not (REPO / path).is_file()]
    for registry_name, names in REGISTERED.items():
        found = getattr(registry, registry_name)
        assert all(found.get(name) is not None for name in names), registry_name


def _changelog_rows() -> list[tuple[str, str]]:
    """(old, new) of every row of CHANGELOG.md's tables of removed paths and names."""
    text = (REPO / "CHANGELOG.md").read_text(encoding="utf-8")
    return re.findall(r"^\| `(xtuner_rope[\w.]*)` \| `(xtuner_rope[\w.]*)` \|", text, re.M)


def _exists(dotted: str) -> bool:
    """``dotted`` imports as a module, or is a name of the module before its last dot."""
    try:
        importlib.import_module(dotted)
        return True
    except ImportError:
        module, _, name = dotted.rpartition(".")
        try:
            return hasattr(importlib.import_module(module), name)
        except ImportError:
            return False


def test_the_changelog_names_what_is_gone_and_where_it_is_now():
    rows = _changelog_rows()
    assert len(rows) >= 40, rows  # the module paths and the names of 0.2.0
    still_there = [old for old, _ in rows if _exists(old)]
    missing = [new for _, new in rows if not _exists(new)]
    assert not still_there, f"CHANGELOG.md says these are gone: {still_there}"
    assert not missing, f"CHANGELOG.md points to nothing: {missing}"


def test_the_docs_name_no_removed_path():
    old = {path for path, _ in _changelog_rows()}
    named = {f"{module}.{name}" for module, name in _readme_names()} | {
        module for module, _ in _readme_names()
    }
    assert not sorted(old & named), sorted(old & named)
