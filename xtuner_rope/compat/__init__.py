"""Every patch xtuner-rope applies to a third-party package, in one place: this package.

One module per third party and gap (``torch_cpu``, ``bitsandbytes_triton``,
``transformers_internlm2``, ``mmengine_dist``, ``mmengine_scheduler``, ``deepspeed_cpu``,
``batch_host_copies``, ``checkpoint``, ``checkpoint_files``, ``checkpoint_world``,
``checkpoint_save``, ``xtuner_sft``,
``xtuner_packing``, ``xtuner_tokenize``, ``xtuner_model_resource``, ``xtuner_llava``, ``xtuner_internvl``,
``xtuner_preference``, ``xtuner_zero_read``, ``xtuner_to_hf``, ``xtuner_merge``;
``mmengine_config``: :func:`config_dict`, MMEngine's private config
dict read in one place; ``versions``: the supported torch and DeepSpeed releases). Each patch has a record (``records.RECORDS``: the versions it was
written for, the names it replaces, the feature it serves, the symptom it removes) and runs in
a guard (``guard.run_guarded``): outside those versions, with a probed name missing, or if the
patch raises, it is skipped with one :class:`CompatPatchSkipped` warning naming the feature,
and :func:`skipped` says why; the start-up then refuses the configs that need that feature
(``xtuner_rope.config.patch_needs``). Inside them a patch still decides itself whether its gap
exists here (most only on a CPU-only machine, or on the releases that have the bug) and leaves
everything else as it was. ``apply()`` is idempotent and runs when ``xtuner_rope`` is
imported; it never raises. Every public name of the modules is importable from here.
"""

from __future__ import annotations

import importlib
import warnings

from .batch_host_copies import patch_mmengine_host_copies, patch_xtuner_varlen_hook_host_copies
from .bitsandbytes_triton import patch_bitsandbytes_triton_probe, triton_lacks_ops
from .checkpoint import patch_checkpoint_loading
from .checkpoint_files import (
    IncompleteCheckpointError,
    Verdict,
    checkpoint_number,
    deepspeed_layout,
    judge_checkpoint,
    newest_complete,
    numbered_checkpoints,
    refuse_incomplete,
)
from .checkpoint_save import (
    CheckpointWriteError,
    find_latest_complete_checkpoint,
    patch_checkpoint_writes,
    save_atomically,
    save_checkpoint_atomically,
    write_atomically,
)
from .checkpoint_world import (
    WorldSizeMismatchError,
    current_world_size,
    refuse_other_world_size,
    saved_world_size,
)
from .deepspeed_cpu import (
    deepspeed_flat_buffer_requires_grad,
    patch_deepspeed_cpu_allgather_grad_mode,
    patch_deepspeed_zero3_cpu_gather,
)
from .devices import cpu_only, gloo_all_to_all_missing
from .guard import (
    CompatPatchSkipped,
    CompatPatchUnavailable,
    PatchRecord,
    applied,
    check_only,
    install_hint,
    installed_version,
    outcomes,
    require,
    run_guarded,
    skip_message,
    skipped,
)
from .mmengine_config import ConfigDictUnavailable, config_dict, is_config
from .mmengine_dist import patch_mmengine_ddp_device_ids_on_cpu, patch_mmengine_dist_init_on_cpu
from .mmengine_scheduler import SCHEDULER_CHECKS, patch_mmengine_warmup_rounding
from .records import DEFERRED, RECORDS, records_table
from .torch_cpu import patch_torch_cpu_bf16_query
from .transformers_internlm2 import (
    patch_internlm2_generation_from_embeds,
    register_internlm2_auto_classes,
)
from .versions import (
    SUPPORTED,
    UnsupportedVersionWarning,
    VersionRange,
    unsupported,
    version_message,
    warn_unsupported,
)
from .xtuner_internvl import (
    INTERNVL_LOAD,
    patch_internvl_dataset_template,
    patch_internvl_loading,
    patch_internvl_predict,
    patch_internvl_rank,
)
from .xtuner_llava import patch_llava_expansion_check, patch_llava_predict_labels
from .xtuner_merge import MERGE_BASE_CLASSES, merge_loading_in
from .xtuner_model_resource import (
    config_being_started,
    keep_other_model_paths,
    patch_model_resource_llm_path,
    patch_set_model_resource_llm_path,
)
from .xtuner_packing import xtuner_intern_repo_packer, xtuner_pack_step
from .xtuner_preference import (
    patch_dpo_predict_reference,
    patch_preference_map_fn_errors,
    patch_preference_truncation_counted,
    patch_preference_unpacked_pairs,
    patch_xtuner_preference_rank,
    patch_xtuner_preference_target_zero,
)
from .xtuner_sft import (
    patch_sft_forward_names_missing_hook,
    patch_sft_sequence_parallel_loss,
    patch_xtuner_train_sequence_parallel_check,
)
from .xtuner_to_hf import TO_HF_CLASSES, to_hf_in_dtype
from .xtuner_tokenize import patch_xtuner_tokenize_counted, xtuner_tokenize_step
from .xtuner_zero_read import (
    ZERO_READ_FEATURE,
    ZERO_READER_FUNCTIONS,
    ZERO_READER_MODULE,
    patch_xtuner_zero_read_fp32,
)

__all__ = [
    "apply",
    "applied",
    "outcomes",
    "skipped",
    "skip_message",
    "SUPPORTED",
    "UnsupportedVersionWarning",
    "unsupported",
    "warn_unsupported",
    "VersionRange",
    "version_message",
    "run_patch",
    "require",
    "run_guarded",
    "CompatPatchSkipped",
    "CompatPatchUnavailable",
    "PatchRecord",
    "RECORDS",
    "DEFERRED",
    "records_table",
    "config_dict",
    "is_config",
    "ConfigDictUnavailable",
    "check_only",
    "install_hint",
    "installed_version",
    "triton_lacks_ops",
    "deepspeed_flat_buffer_requires_grad",
    "cpu_only",
    "gloo_all_to_all_missing",
    "SCHEDULER_CHECKS",
    "MOVED_NAMES",
    "patch_torch_cpu_bf16_query",
    "patch_bitsandbytes_triton_probe",
    "register_internlm2_auto_classes",
    "patch_internlm2_generation_from_embeds",
    "patch_mmengine_dist_init_on_cpu",
    "patch_mmengine_ddp_device_ids_on_cpu",
    "patch_mmengine_warmup_rounding",
    "patch_mmengine_host_copies",
    "patch_xtuner_varlen_hook_host_copies",
    "patch_deepspeed_cpu_allgather_grad_mode",
    "patch_deepspeed_zero3_cpu_gather",
    "patch_checkpoint_loading",
    "patch_checkpoint_writes",
    "IncompleteCheckpointError",
    "CheckpointWriteError",
    "Verdict",
    "checkpoint_number",
    "judge_checkpoint",
    "deepspeed_layout",
    "newest_complete",
    "numbered_checkpoints",
    "refuse_incomplete",
    "WorldSizeMismatchError",
    "current_world_size",
    "refuse_other_world_size",
    "saved_world_size",
    "find_latest_complete_checkpoint",
    "save_atomically",
    "save_checkpoint_atomically",
    "write_atomically",
    "patch_sft_forward_names_missing_hook",
    "patch_sft_sequence_parallel_loss",
    "patch_xtuner_train_sequence_parallel_check",
    "xtuner_intern_repo_packer",
    "xtuner_pack_step",
    "xtuner_tokenize_step",
    "apply_counting",
    "patch_xtuner_tokenize_counted",
    "patch_model_resource_llm_path",
    "patch_set_model_resource_llm_path",
    "config_being_started",
    "keep_other_model_paths",
    "patch_llava_expansion_check",
    "patch_llava_predict_labels",
    "INTERNVL_LOAD",
    "patch_internvl_loading",
    "patch_internvl_rank",
    "patch_internvl_dataset_template",
    "patch_internvl_predict",
    "patch_xtuner_preference_rank",
    "patch_xtuner_preference_target_zero",
    "patch_preference_unpacked_pairs",
    "patch_preference_truncation_counted",
    "patch_preference_map_fn_errors",
    "patch_dpo_predict_reference",
    "patch_xtuner_zero_read_fp32",
    "to_hf_in_dtype",
    "TO_HF_CLASSES",
    "ZERO_READ_FEATURE",
    "ZERO_READER_FUNCTIONS",
    "ZERO_READER_MODULE",
    "merge_loading_in",
    "MERGE_BASE_CLASSES",
]

# Model patches that lived here once and now live with their family in ``models``.
MOVED_NAMES = {"patch_hf_fp32_rotation": "xtuner_rope.models.hf_rope"}


def __getattr__(name: str) -> object:
    """``compat.<moved name>``: the name from its new module, with a warning naming it."""
    if name not in MOVED_NAMES:
        raise AttributeError(f"module 'xtuner_rope.compat' has no attribute {name!r}")
    new = MOVED_NAMES[name]
    warnings.warn(
        f"xtuner_rope.compat.{name} is deprecated: it is a model patch, import it from "
        f"{new} (`from {new} import {name}`).",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module(new), name)


def run_patch(patch, *args, **kwargs) -> object:
    """Run ``patch(*args, **kwargs)`` in its record's guard (for the patches applied later).

    Returns:
        The patch's result, or False where it was skipped (one ``CompatPatchSkipped``
        warning) or is not needed here.
    """
    return run_guarded(RECORDS[patch.__name__], patch, *args, **kwargs)


def _check_deferred() -> None:
    """Versions and probes of the patches applied later: a skip is known (and warned) now."""
    for record in DEFERRED:
        check_only(record)


def apply() -> list[str]:
    """Apply every patch whose gap exists here, each in its guard; never raises.

    Safe to call any number of times. torch or DeepSpeed outside the supported range gets one
    ``UnsupportedVersionWarning`` (``versions``). A patch outside its versions, with a probed name
    missing, or that raises is skipped with one ``CompatPatchSkipped`` warning (see
    :func:`skipped`); the patches applied later (``DEFERRED``) are checked the same way now.

    Returns:
        The names of the patches applied so far in this process.
    """
    warn_unsupported()
    for patch in (
        patch_torch_cpu_bf16_query,
        patch_bitsandbytes_triton_probe,
        register_internlm2_auto_classes,
        patch_mmengine_dist_init_on_cpu,
        patch_mmengine_ddp_device_ids_on_cpu,
        patch_deepspeed_cpu_allgather_grad_mode,
        patch_deepspeed_zero3_cpu_gather,
        patch_checkpoint_loading,
        patch_checkpoint_writes,
        patch_sft_forward_names_missing_hook,
        patch_model_resource_llm_path,
        patch_set_model_resource_llm_path,
        patch_xtuner_preference_rank,
        patch_xtuner_preference_target_zero,
        patch_preference_unpacked_pairs,
        patch_preference_map_fn_errors,
        patch_dpo_predict_reference,
        patch_sft_sequence_parallel_loss,
        patch_xtuner_train_sequence_parallel_check,
        patch_internlm2_generation_from_embeds,
        patch_mmengine_warmup_rounding,
        patch_internvl_loading,
        patch_internvl_rank,
        patch_internvl_dataset_template,
        patch_internvl_predict,
        patch_llava_predict_labels,
        patch_xtuner_zero_read_fp32,
        patch_mmengine_host_copies,
        patch_xtuner_varlen_hook_host_copies,
    ):
        if patch.__name__ not in applied():
            run_patch(patch)
    _check_deferred()
    return applied()


def apply_counting(counted_step, counted_class) -> list[str]:
    """The two counting patches, with the wrappers of the floor above (``data``) handed in.

    ``xtuner_rope.activate`` calls it right after :func:`apply`: XTuner's ``tokenize_dataset``
    wrapped by ``counted_step`` and ``PreferenceDataset`` replaced by
    ``counted_class(PreferenceDataset)``, each in its guard (a skip loses the count, never data).

    Returns:
        The names of the patches applied so far in this process.
    """
    if "patch_xtuner_tokenize_counted" not in applied():
        run_patch(patch_xtuner_tokenize_counted, counted_step)
    if "patch_preference_truncation_counted" not in applied():
        run_patch(patch_preference_truncation_counted, counted_class)
    return applied()
