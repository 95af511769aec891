"""Every patch xtuner-rope applies to a third-party package, in one place: this package.

One module per third party and gap (docs/compat.md lists them). Each patch has a record
(``records.RECORDS``) and runs in a guard (``guard.run_guarded``); it returns True once applied,
False where its gap is not here. This module holds :func:`apply` (idempotent, never raises),
:func:`apply_counting` and :func:`run_patch`.
"""

from __future__ import annotations

from types import ModuleType

from . import (  # noqa: F401  (the records name their patches: :func:`patch_named`)
    batch_host_copies,
    bitsandbytes_triton,
    deepspeed_cpu,
    mmengine_dist,
    mmengine_scheduler,
    runner_checkpoints,
    torch_cpu,
    transformers_internlm2,
    xtuner_internvl,
    xtuner_llava,
    xtuner_model_resource,
    xtuner_preference,
    xtuner_sft,
    xtuner_tokenize,
    xtuner_zero_read,
)
from .guard import applied, check_only, run_guarded
from .records import ACTIVATION, DEFERRED, RECORDS
from .versions import warn_unsupported

__all__ = ["apply", "apply_counting", "patch_named", "run_patch"]


def patch_named(name: str):
    """The patch function a record of ``ACTIVATION`` or ``COUNTING`` names (in its module)."""
    modules = [value for value in globals().values() if isinstance(value, ModuleType)]
    return next(getattr(m, name) for m in modules if callable(getattr(m, name, None)))


def run_patch(patch, *args, **kwargs) -> object:
    """Run ``patch(*args, **kwargs)`` in its record's guard: once per process, or at every call for
    a patch applied for one call (``DEFERRED``).

    Returns:
        The patch's result, or False where it was skipped (one ``CompatPatchSkipped`` warning) or
        is not needed here.
    """
    record = RECORDS[patch.__name__]
    return run_guarded(record, patch, *args, once=record not in DEFERRED, **kwargs)


def apply() -> list[str]:
    """Apply every patch of ``records.ACTIVATION`` whose gap exists here, each in its guard; never
    raises, any number of times. One ``UnsupportedVersionWarning`` for torch or DeepSpeed outside
    the supported range; the patches applied later (``DEFERRED``) are checked now too. Returns
    the names of the patches applied so far in this process.
    """
    warn_unsupported()
    for record in ACTIVATION:
        run_patch(patch_named(record.name))
    for record in DEFERRED:  # applied later: a skip is known (and warned) now
        check_only(record)
    return applied()


def apply_counting(counted_step, counted_class) -> list[str]:
    """The two counting patches, with the wrappers of the floor above (``data``) handed in:
    ``counted_step(tokenize_dataset)`` and ``counted_class(PreferenceDataset)``, each guarded (a
    skip loses the count, never data). Returns the names of the patches applied so far.
    """
    run_patch(xtuner_tokenize.patch_xtuner_tokenize_counted, counted_step)
    run_patch(xtuner_preference.patch_preference_truncation_counted, counted_class)
    return applied()
