"""Names users were told to use keep working: the README's, earlier READMEs', every `__all__`.

A name the README has documented is API. `PUBLIC` lists them (today's `__all__` of every module,
the names today's and earlier READMEs and recipes told users to import, name in a config or
run); the test fails if one disappears. Moving a name is fine: keep the old import working,
with a warning that names the new one where it is deprecated (`DEPRECATED`).
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
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
    ],
    "xtuner_rope.startup": [
        "ConfigConflict",
        "Finding",
        "enable_xtuner_rope",
        "inspect_config",
        "is_prepared",
        "prepare_config",
        "require_prepared",
    ],
    "xtuner_rope.hooks": [
        "PackedBatchCheckHook",
        "ValidatedRoPEHook",
        # issue 27: the hooks/ folder holds every hook
        "NonFiniteTripwireHook",
        "PackingMetricsHook",
        "TokenWeightedLossHook",
    ],
    "xtuner_rope.monitor": ["NonFiniteError", "NonFiniteTripwireHook", "PackingMetricsHook"],
    "xtuner_rope.collate": ["rope_collate_fn", "IGNORE_INDEX", "DEFAULT_PAD_TOKEN_INDEX"],
    "xtuner_rope.collate_llava": ["llava_collate_fn"],
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
    "xtuner_rope.doctor.replay": [
        "Finding",
        "build_run_model",
        "load_record",
        "replay",
        "save_record",
    ],
    "xtuner_rope.demo.resources": ["tiny_checkpoint"],
    "xtuner_rope.demo.runlog": ["check_run", "train_losses"],
    "xtuner_rope.doctor.xtuner_tools": [
        "XTUNER_TOOLS",
        "resolved_model_options",
        "run_xtuner_tool",
    ],
    # Before the batch/ops split the README named this module as the public batch check.
    "xtuner_rope.validate": ["check_packed_batch"],
    # Issue 27's layout: the role folders' own paths (the old ones above still import).
    "xtuner_rope.config.startup": [
        "enable_xtuner_rope",
        "inspect_config",
        "register_findings",
        "state_kept",
    ],
    "xtuner_rope.data.collate": ["rope_collate_fn"],
    "xtuner_rope.data.collate_llava": ["llava_collate_fn"],
    "xtuner_rope.models.dispatch": [
        "isolates_documents",
        "language_model",
        "patch_model",
        "unwrap_model",
    ],
    # Issue 35: `xtuner-rope check` and the captures, by job (the old doctor.* paths import too).
    "xtuner_rope.check": ["run_check", "format_summary", "write_report", "KINDS", "TOLERANCES"],
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
    # The names the docs gave these before issue 35, at their old paths.
    "xtuner_rope.doctor.check": ["run_check", "start_config", "train_dtype", "first_batches"],
    "xtuner_rope.doctor.check_report": ["TOLERANCES", "judge", "format_summary", "write_report"],
    "xtuner_rope.doctor.check_capture": ["IsolationCaptureHook", "compare_capture"],
    "xtuner_rope.doctor.llava_capture": ["LLaVAIsolationCaptureHook", "compare_llava_capture"],
    "xtuner_rope.doctor.preference_capture": [
        "PreferenceCaptureHook",
        "compare_preference_capture",
    ],
    # Earlier READMEs' `model_resource` targets (deprecated, see DEPRECATED).
    "xtuner_rope.resources": ["enable_xtuner_rope", "local_checkpoint", "tiny_internlm2"],
}
# Old paths that moved: importing them warns and names the replacement (issue 27's layout).
DEPRECATED_MODULES = {
    "xtuner_rope.startup": "xtuner_rope.config.startup",
    "xtuner_rope.startup_multimodal": "xtuner_rope.config.multimodal",
    "xtuner_rope.startup_sequence_parallel": "xtuner_rope.config.sequence_parallel",
    "xtuner_rope.launch_findings": "xtuner_rope.config.launch",
    "xtuner_rope.preference": "xtuner_rope.config.preference",
    "xtuner_rope.overrides": "xtuner_rope.config.overrides",
    "xtuner_rope.collate": "xtuner_rope.data.collate",
    "xtuner_rope.collate_llava": "xtuner_rope.data.collate_llava",
    "xtuner_rope.packed_dataset": "xtuner_rope.data.packed_dataset",
    "xtuner_rope.monitor": "xtuner_rope.hooks.monitor",
    "xtuner_rope.loss_norm": "xtuner_rope.hooks.loss_norm",
    "xtuner_rope.checkpoint": "xtuner_rope.compat.checkpoint",
    "xtuner_rope.validate": "xtuner_rope.batch.checks",
    # Issue 35: the top floor sorted by job.
    "xtuner_rope.doctor.check": "xtuner_rope.check",
    "xtuner_rope.doctor.check_report": "xtuner_rope.check",
    "xtuner_rope.doctor.check_preference": "xtuner_rope.check.preference",
    "xtuner_rope.doctor.llava_check": "xtuner_rope.check.llava",
    "xtuner_rope.doctor.check_measure": "xtuner_rope.capture.measure",
    "xtuner_rope.doctor.check_randomness": "xtuner_rope.capture.randomness",
    "xtuner_rope.doctor.check_capture": "xtuner_rope.capture.text",
    "xtuner_rope.doctor.llava_capture": "xtuner_rope.capture.llava",
    "xtuner_rope.doctor.preference_capture": "xtuner_rope.capture.preference",
    "xtuner_rope.doctor.replay": "xtuner_rope.outputs.replay",
    "xtuner_rope.doctor.xtuner_tools": "xtuner_rope.outputs.xtuner_tools",
    "xtuner_rope.config.heldout_files": "xtuner_rope.config.heldout.files",
    "xtuner_rope.config.heldout_pairs": "xtuner_rope.config.heldout.models",
    "xtuner_rope.config.heldout_shortcut": "xtuner_rope.config.heldout.shortcut",
}
DEPRECATED_NAMES = [
    ("xtuner_rope.hooks", "patch_model", "xtuner_rope.models.dispatch"),
    ("xtuner_rope.hooks", "isolates_documents", "xtuner_rope.models.dispatch"),
    ("xtuner_rope.compat", "patch_hf_fp32_rotation", "xtuner_rope.models.hf_rope"),
]
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
    assert not missing, f"{module} lost public names {missing}: keep a (deprecated) alias"


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


def test_local_checkpoint_is_a_warning_alias(tmp_path):
    from xtuner_rope.resources import local_checkpoint

    (tmp_path / "config.json").write_text("{}")
    with pytest.warns(
        FutureWarning,
        match=r"local_checkpoint is deprecated.*\n.*from xtuner_rope "
        r"import enable_xtuner_rope\n.*model_resource = dict\(fn=enable_xtuner_rope, "
        r"args=dict\(local_only=True\)\)",
    ):
        assert local_checkpoint(str(tmp_path)) == str(tmp_path)
    with (
        pytest.warns(FutureWarning),
        pytest.raises(FileNotFoundError, match="is not a local checkpoint directory"),
    ):
        local_checkpoint(str(tmp_path / "missing"))


def test_tiny_internlm2_is_a_warning_alias(tmp_path):
    from xtuner_rope.resources import tiny_internlm2

    (tmp_path / "config.json").write_text("{}")  # present: nothing is built
    with pytest.warns(
        FutureWarning,
        match=r"tiny_internlm2 is deprecated.*\n.*"
        r"from xtuner_rope.demo.resources import tiny_checkpoint",
    ):
        assert tiny_internlm2(str(tmp_path)) == str(tmp_path)


@pytest.mark.parametrize("old", sorted(DEPRECATED_MODULES))
def test_an_old_module_path_is_the_new_module_with_a_warning(old, monkeypatch):
    new = importlib.import_module(DEPRECATED_MODULES[old])
    monkeypatch.delitem(sys.modules, old, raising=False)  # warn again even if imported before
    with pytest.warns(
        DeprecationWarning,
        match=rf"{re.escape(old)} is deprecated: it moved to "
        rf"{re.escape(DEPRECATED_MODULES[old])}",
    ):
        moved = importlib.import_module(old)
    assert moved is new  # one module object: its state (e.g. the start-up's) is shared


@pytest.mark.parametrize(("module", "name", "new"), DEPRECATED_NAMES)
def test_an_old_name_warns_and_is_the_new_one(module, name, new):
    with pytest.warns(
        DeprecationWarning,
        match=rf"{re.escape(module)}\.{name} is deprecated.*"
        rf"{re.escape(new)}",
    ):
        value = getattr(importlib.import_module(module), name)
    assert value is getattr(importlib.import_module(new), name)


def test_the_warning_names_the_release_that_drops_the_old_path():
    from xtuner_rope.deprecated import REMOVED_IN, message

    assert REMOVED_IN.count(".") == 2 and f"until xtuner-rope {REMOVED_IN}" in message(
        "xtuner_rope.doctor.check"
    )


def test_the_table_of_old_paths_is_the_packages():
    from xtuner_rope.deprecated import MOVED

    assert MOVED == DEPRECATED_MODULES


def test_check_packed_batch_at_its_documented_path():
    from xtuner_rope.batch.checks import check_packed_batch

    with pytest.warns(DeprecationWarning):
        sys.modules.pop("xtuner_rope.validate", None)
        from xtuner_rope.validate import check_packed_batch as old
    assert old is check_packed_batch


def test_the_config_import_activates_the_plugin_even_after_ops_alone():
    """A config's `from xtuner_rope import enable_xtuner_rope` patches and registers, also in a
    process that had imported only the (patch-free) math before."""
    code = (
        "import sys, xtuner_rope.ops.packing\n"
        "assert 'mmengine' not in sys.modules\n"
        "from xtuner_rope import enable_xtuner_rope\n"
        "from mmengine.registry import FUNCTIONS, HOOKS\n"
        "from transformers.models.auto.configuration_auto import CONFIG_MAPPING\n"
        "assert 'internlm2' in CONFIG_MAPPING, 'compat.apply() did not run'\n"
        "missing = [n for n in ('ValidatedRoPEHook', 'PackedBatchCheckHook', 'PackingMetricsHook',"
        " 'NonFiniteTripwireHook', 'TokenWeightedLossHook') if HOOKS.get(n) is None]\n"
        "missing += [n for n in ('rope_collate_fn', 'llava_collate_fn') if FUNCTIONS.get(n) is None]\n"
        "assert not missing, missing\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
