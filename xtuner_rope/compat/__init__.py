"""Every patch xtuner-rope applies to a third-party package, in one place: this package.

One module per third party and gap (docs/compat.md lists them); ``mmengine_config`` reads
MMEngine's private config dict in one place, ``versions`` holds the supported torch and
DeepSpeed releases, ``devices`` what this machine lacks. Each patch has a record
(``records.RECORDS``) and runs in a guard (``guard.run_guarded``): outside its versions, with a
probed name missing, or if it raises, it is skipped with one ``guard.CompatPatchSkipped``
warning, and the start-up refuses the configs that need its feature (``config.patch_needs``).

This module holds what applies them: :func:`apply` (idempotent, never raises; run by
``xtuner_rope.activate``), :func:`apply_counting` and :func:`run_patch`.
"""

from __future__ import annotations

from .batch_host_copies import patch_mmengine_host_copies, patch_xtuner_varlen_hook_host_copies
from .bitsandbytes_triton import patch_bitsandbytes_triton_probe
from .deepspeed_cpu import patch_deepspeed_cpu_allgather_grad_mode, patch_deepspeed_zero3_cpu_gather
from .guard import applied, check_only, run_guarded
from .mmengine_dist import patch_mmengine_ddp_device_ids_on_cpu, patch_mmengine_dist_init_on_cpu
from .mmengine_scheduler import patch_mmengine_warmup_rounding
from .records import DEFERRED, RECORDS
from .runner_checkpoints import (
    patch_checkpoint_loading,
    patch_checkpoint_writes,
    patch_deepspeed_checkpoint_writes,
)
from .torch_cpu import patch_torch_cpu_bf16_query
from .transformers_internlm2 import (
    patch_internlm2_generation_from_embeds,
    register_internlm2_auto_classes,
)
from .versions import warn_unsupported
from .xtuner_internvl import (
    patch_internvl_dataset_template,
    patch_internvl_loading,
    patch_internvl_predict,
    patch_internvl_rank,
)
from .xtuner_llava import patch_llava_predict_labels
from .xtuner_model_resource import patch_model_resource_llm_path, patch_set_model_resource_llm_path
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
from .xtuner_tokenize import patch_xtuner_tokenize_counted
from .xtuner_zero_read import patch_xtuner_zero_read_fp32

__all__ = ["apply", "apply_counting", "run_patch"]


def run_patch(patch, *args, **kwargs) -> object:
    """Run ``patch(*args, **kwargs)`` in its record's guard.

    A process-wide patch runs once per process (the guard's "already applied"); a patch applied
    for one call (``DEFERRED``: a config's model paths, one dataset build, one model's check)
    runs at every call.

    Returns:
        The patch's result, or False where it was skipped (one ``CompatPatchSkipped``
        warning) or is not needed here.
    """
    record = RECORDS[patch.__name__]
    return run_guarded(record, patch, *args, once=record not in DEFERRED, **kwargs)


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
        patch_deepspeed_checkpoint_writes,
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
        run_patch(patch)  # the guard runs each patch once per process
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
    run_patch(patch_xtuner_tokenize_counted, counted_step)
    run_patch(patch_preference_truncation_counted, counted_class)
    return applied()
