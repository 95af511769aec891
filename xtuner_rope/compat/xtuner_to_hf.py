"""XTuner patch, for one conversion: ``to_hf`` saves in the dtype asked, not fp16-or-fp32.

xtuner 0.2.0's ``to_hf`` casts ``.half()`` unless ``fp32=True``. :func:`to_hf_in_dtype` wraps
it while ``xtuner-rope convert pth_to_hf --dtype`` runs: ``prepare(model)`` first, no
``.half()``. Not in ``compat.apply()``; a missing class is skipped with a warning naming it.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

# Where xtuner 0.2.0 defines a ``to_hf(self, cfg, save_dir, fp32=False, ...)`` of its own.
TO_HF_CLASSES = (
    ("xtuner.model.sft", "SupervisedFinetune"),
    ("xtuner.model.llava", "LLaVAModel"),
    ("xtuner.model.reward", "RewardModel"),
)


def _classes() -> list[type]:
    """The classes of :data:`TO_HF_CLASSES` that exist here with a ``to_hf`` of their own."""
    found = []
    for module, name in TO_HF_CLASSES:
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            cls = None
        if cls is None or "to_hf" not in vars(cls):
            warnings.warn(
                f"xtuner-rope convert --dtype: {module}.{name}.to_hf is missing (written for "
                "xtuner 0.2.0): that model saves as XTuner decides (fp16, or fp32 with --fp32).",
                stacklevel=3,
            )
            continue
        found.append(cls)
    return found


def _wrap(original: Callable, prepare: Callable) -> Callable:
    def to_hf(self, *args, fp32: bool = False, **kwargs):
        prepare(self)  # the model in the dtype asked, losses counted
        return original(self, *args, fp32=True, **kwargs)  # and no .half() after it

    to_hf.__wrapped__ = original
    return to_hf


@contextmanager
def to_hf_in_dtype(prepare: Callable) -> Iterator[list[type]]:
    """While inside, XTuner's ``to_hf`` first calls ``prepare(model)`` and never ``.half()``.

    Args:
        prepare: Called with the XTuner model (an ``nn.Module``) before it is saved; it casts
            the model to the dtype asked.

    Yields:
        The classes wrapped (XTuner's ``to_hf`` of any other class is unchanged).
    """
    classes = _classes()
    originals = {cls: vars(cls)["to_hf"] for cls in classes}
    try:
        for cls, original in originals.items():
            cls.to_hf = _wrap(original, prepare)
        yield classes
    finally:
        for cls, original in originals.items():
            cls.to_hf = original


__all__ = ["TO_HF_CLASSES", "to_hf_in_dtype"]
