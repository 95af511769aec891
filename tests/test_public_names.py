"""Names users were told to use keep working: the README's, earlier READMEs', every `__all__`.

A name the README has documented is API. `PUBLIC` lists them (today's `__all__` of every module,
the names today's and earlier READMEs and recipes told users to import, name in a config or
run); the test fails if one disappears. Moving a name is fine: keep the old import working,
with a warning that names the new one where it is deprecated (`DEPRECATED`).
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PUBLIC = {
    "xtuner_rope": ["NonFiniteTripwireHook", "PackedBatchCheckHook", "PackingMetricsHook",
                    "ValidatedRoPEHook", "ValidatedRotaryEmbedding", "apply_rotary_pos_emb",
                    "enable_xtuner_rope", "patch_internlm2_attention", "rope_collate_fn"],
    "xtuner_rope.startup": ["ConfigConflict", "Finding", "enable_xtuner_rope", "inspect_config",
                            "is_prepared", "prepare_config", "require_prepared"],
    "xtuner_rope.hooks": ["PackedBatchCheckHook", "ValidatedRoPEHook"],
    "xtuner_rope.monitor": ["NonFiniteError", "NonFiniteTripwireHook", "PackingMetricsHook"],
    "xtuner_rope.collate": ["rope_collate_fn", "IGNORE_INDEX", "DEFAULT_PAD_TOKEN_INDEX"],
    "xtuner_rope.collate_llava": ["llava_collate_fn"],
    "xtuner_rope.batch.items": ["Sample", "parse_sample", "check_id_range", "is_supervised",
                                "item_error", "IGNORE_INDEX"],
    "xtuner_rope.ops.rope": ["apply_rotary_pos_emb", "check_position_ids", "cos_sin",
                             "cos_sin_at", "inv_freq", "rotate_half", "use_fused_apply"],
    "xtuner_rope.models.internlm2_rope": ["ValidatedRotaryEmbedding"],
    "xtuner_rope.models.runtime": ["VARLEN_HUB", "CUMULATIVE_KEY", "MAX_SEQLEN_KEY",
                                   "batch_document_plan", "choose_backend",
                                   "hub_cumulative_len"],
    "xtuner_rope.ops.boundaries": ["check_flat_boundaries"],
    "xtuner_rope.batch.record": ["RECORD_FORMAT", "load_record", "save_record"],
    "xtuner_rope.ops.positions": ["check_position_ids"],
    "xtuner_rope.batch.checks": ["check_packed_batch", "check_flat_boundaries", "row_boundaries"],
    "xtuner_rope.ops.packing": ["cumulative_from_lengths", "lengths_from_cumulative",
                                "position_ids_from_cumulative", "cumulative_from_position_ids",
                                "segment_starts_from_cumulative", "position_ids_from_starts",
                                "flat_cumulative", "plan_packs", "padded_length"],
    "xtuner_rope.batch.stats": ["BatchStats", "batch_stats", "segment_ids"],
    "xtuner_rope.ops.inputs": ["show", "to_int_tensor"],
    "xtuner_rope.models": ["HF_ATTENTION_CLASSES", "INTERNLM2_ATTENTION_CLASSES",
                           "PACKED_ATTENTION_KEY", "SUPPORTED_ROPE_TYPES",
                           "HFValidatedRotaryEmbedding", "integration_for",
                           "is_patched_hf_attention", "patch_hf_model",
                           "patch_internlm2_attention"],
    "xtuner_rope.doctor.replay": ["Finding", "build_run_model", "load_record", "replay",
                                  "save_record"],
    "xtuner_rope.demo.resources": ["tiny_checkpoint"],
    "xtuner_rope.demo.runlog": ["check_run", "train_losses"],
    "xtuner_rope.doctor.xtuner_tools": ["XTUNER_TOOLS", "resolved_model_options",
                                        "run_xtuner_tool"],
    # Earlier READMEs' `model_resource` targets (deprecated, see DEPRECATED).
    "xtuner_rope.resources": ["enable_xtuner_rope", "local_checkpoint", "tiny_internlm2"],
}
# Commands and scripts the README (today's or earlier) tells users to run.
COMMANDS = ["doctor", "convert", "chat"]
TOOLS = ["tools/check_run.py", "tools/replay_batch.py", "tools/make_sample_data.py",
         "tools/make_preference_data.py",
         "tools/make_tiny_internlm2.py", "tools/setup_env.sh", "tools/bench/packing.py",
         "tools/bench/rope.py", "tools/bench/hook_overhead.py", "tools/bench/monitor_overhead.py"]
# Config `type='Name'` strings resolved through MMEngine's root registries.
REGISTERED = {"HOOKS": ["ValidatedRoPEHook", "PackedBatchCheckHook", "PackingMetricsHook",
                        "NonFiniteTripwireHook"], "FUNCTIONS": ["rope_collate_fn"]}


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
    assert {command: _exit_status([command, "-h"]) for command in COMMANDS} == \
        dict.fromkeys(COMMANDS, 0)
    assert _exit_status(["no-such-command"]) == 2
    assert "--prompt-template" in capsys.readouterr().out  # XTuner's chat help came through
    assert not [path for path in TOOLS if not (REPO / path).is_file()]
    for registry_name, names in REGISTERED.items():
        found = getattr(registry, registry_name)
        assert all(found.get(name) is not None for name in names), registry_name


def test_local_checkpoint_is_a_warning_alias(tmp_path):
    from xtuner_rope.resources import local_checkpoint

    (tmp_path / "config.json").write_text("{}")
    with pytest.warns(FutureWarning, match=r"local_checkpoint is deprecated.*\n.*from xtuner_rope "
                      r"import enable_xtuner_rope\n.*model_resource = dict\(fn=enable_xtuner_rope, "
                      r"args=dict\(local_only=True\)\)"):
        assert local_checkpoint(str(tmp_path)) == str(tmp_path)
    with pytest.warns(FutureWarning), \
            pytest.raises(FileNotFoundError, match="is not a local checkpoint directory"):
        local_checkpoint(str(tmp_path / "missing"))


def test_tiny_internlm2_is_a_warning_alias(tmp_path):
    from xtuner_rope.resources import tiny_internlm2

    (tmp_path / "config.json").write_text("{}")  # present: nothing is built
    with pytest.warns(FutureWarning, match=r"tiny_internlm2 is deprecated.*\n.*"
                      r"from xtuner_rope.demo.resources import tiny_checkpoint"):
        assert tiny_internlm2(str(tmp_path)) == str(tmp_path)
