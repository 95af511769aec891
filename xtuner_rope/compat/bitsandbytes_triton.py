"""bitsandbytes patch: its triton probe answered False where triton lacks ``triton.ops``."""

from __future__ import annotations

import importlib.util
import os
import sys
import types


def triton_lacks_ops() -> bool:
    """True if triton is installed without the ``triton.ops`` package (removed in triton 3.2)."""
    spec = importlib.util.find_spec("triton")
    if spec is None or not spec.submodule_search_locations:
        return False
    return not any(
        os.path.isdir(os.path.join(loc, "ops")) for loc in spec.submodule_search_locations
    )


def _forget_failed_bitsandbytes_import() -> bool:
    """Drop the submodules a failed ``import bitsandbytes`` left behind; True if there were any."""
    leftovers = [m for m in sys.modules if m.startswith("bitsandbytes.")]
    if "bitsandbytes" in sys.modules or not leftovers:
        return False
    for name in leftovers:
        del sys.modules[name]
    return True


def patch_bitsandbytes_triton_probe() -> bool:
    """Let bitsandbytes 0.45 (xtuner 0.2.0's pin) import next to a triton without ``triton.ops``.

    Its optional int8 triton kernels import ``triton.ops`` (gone in triton 3.2), failing every
    LoRA/QLoRA ``get_peft_model``. Its own probe (``triton_utils.is_triton_available``) answers
    False (4-bit QLoRA does not use them), after dropping what a failed import left in
    ``sys.modules``. False where triton has ``triton.ops`` or bitsandbytes is fully imported.
    """
    name = "bitsandbytes.triton.triton_utils"
    if "bitsandbytes" in sys.modules or not triton_lacks_ops():
        return False
    _forget_failed_bitsandbytes_import()
    probe = types.ModuleType(name, "xtuner_rope.compat: triton without triton.ops counts as absent")
    probe.is_triton_available = lambda: False
    sys.modules[name] = probe
    return True
