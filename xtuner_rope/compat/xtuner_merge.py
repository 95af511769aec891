"""XTuner patch, for one merge: ``xtuner convert merge`` loads the base in the dtype asked.

xtuner 0.2.0's ``merge.py`` loads the base LLM in fp16 whatever the model, CLIP in fp32;
``xtuner-rope convert merge --dtype`` runs it inside :func:`merge_loading_in`, which hands both
loads the dtype asked. Not in ``compat.apply()``; a class without ``from_pretrained`` is warned
about and left as it is.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

# The classes whose ``from_pretrained`` merge.py calls for the base: the LLM, and CLIP (--is-clip).
MERGE_BASE_CLASSES = ("AutoModelForCausalLM", "CLIPVisionModel")


@contextmanager
def _loading_in(cls: type, dtype: object) -> Iterator[None]:
    """While inside, ``cls.from_pretrained`` loads in ``dtype`` (any ``torch_dtype`` replaced)."""
    original = cls.from_pretrained
    own = vars(cls).get("from_pretrained")  # the class's own attribute, if it has one

    def from_pretrained(*args, **kwargs):
        return original(*args, **{**kwargs, "torch_dtype": dtype})

    cls.from_pretrained = staticmethod(from_pretrained)
    try:
        yield
    finally:
        if own is None:  # inherited: drop the wrapper
            del cls.from_pretrained
        else:
            cls.from_pretrained = own


@contextmanager
def merge_loading_in(dtype: object) -> Iterator[bool]:
    """While inside, every ``from_pretrained`` of :data:`MERGE_BASE_CLASSES` (merge.py's LLM and
    CLIP loads) gets ``torch_dtype=dtype``; yields False (with a warning) when transformers lacks
    one of those classes (that one loads as XTuner decides), else True.
    """
    import transformers

    redirected = True
    with ExitStack() as stack:
        for name in MERGE_BASE_CLASSES:
            cls = getattr(transformers, name, None)
            if getattr(cls, "from_pretrained", None) is None:
                warnings.warn(
                    f"xtuner-rope convert merge --dtype: transformers.{name}.from_pretrained is "
                    "missing (written for transformers 4.48): that merge loads as XTuner decides "
                    "(fp16 for an LLM, fp32 for CLIP).",
                    stacklevel=3,
                )
                redirected = False
                continue
            stack.enter_context(_loading_in(cls, dtype))
        yield redirected


__all__ = ["MERGE_BASE_CLASSES", "merge_loading_in"]
