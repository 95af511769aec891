"""XTuner patch: its DeepSpeed checkpoint reader reads the ZeRO fp32 partitions at fp32.

xtuner 0.2.0's ``guess_load_checkpoint`` (``convert pth_to_hf``, ``pretrained_pth``) reads a
ZeRO folder through ``zero_to_any_dtype`` whose ``DEFAULT_DTYPE`` is fp16, also with ``--fp32``.
The reader's defaults become fp32 (a named ``dtype`` still wins).
"""

from __future__ import annotations

import importlib

ZERO_READER_MODULE = "xtuner.utils.zero_to_any_dtype"
# The functions of xtuner 0.2.0's reader whose last default is DEFAULT_DTYPE (float16).
ZERO_READER_FUNCTIONS = (
    "get_state_dict_from_zero_checkpoint",
    "convert_zero_checkpoint_to_state_dict",
    "load_state_dict_from_zero_checkpoint",
    "_get_state_dict_from_zero_checkpoint",
    "parse_model_states",
)  # parse_optim_states (wrapped by torch.no_grad) is always handed the dtype
ZERO_READ_FEATURE = "xtuner-rope's exact read of DeepSpeed checkpoints (convert pth_to_hf at fp32)"


def patch_xtuner_zero_read_fp32() -> bool:
    """Make xtuner 0.2.0's ZeRO checkpoint reader default to fp32 instead of fp16.

    Returns:
        True if applied; False where the reader defaults to another dtype already (no gap).

    Raises:
        RuntimeError: a reader function has no float16 default (not as xtuner 0.2.0 wrote it):
            the guard skips the patch with one ``CompatPatchSkipped`` warning.
    """
    import torch

    reader = importlib.import_module(ZERO_READER_MODULE)
    if reader.DEFAULT_DTYPE is not torch.float16:
        return False
    functions = [getattr(reader, name, None) for name in ZERO_READER_FUNCTIONS]
    for name, function in zip(ZERO_READER_FUNCTIONS, functions):
        defaults = getattr(function, "__defaults__", None)
        if not defaults or defaults[-1] is not torch.float16:
            raise RuntimeError(f"{ZERO_READER_MODULE}.{name} has no float16 default dtype")
    for function in functions:
        function.__defaults__ = (*function.__defaults__[:-1], torch.float32)
    reader.DEFAULT_DTYPE = torch.float32
    return True


__all__ = [
    "ZERO_READER_MODULE",
    "ZERO_READER_FUNCTIONS",
    "ZERO_READ_FEATURE",
    "patch_xtuner_zero_read_fp32",
]
