"""XTuner patch, for one merge: ``xtuner convert merge`` loads the base in the dtype asked.

xtuner 0.2.0's ``xtuner/tools/model_converters/merge.py`` loads the base model with
``AutoModelForCausalLM.from_pretrained(..., torch_dtype=torch.float16)`` whatever the model or
the adapter: the merged weights ``W + B @ A * alpha / r`` are computed and saved in fp16 (on the
tiny LoRA run: logits 4.8e-4 off the trained model). ``xtuner-rope convert merge --dtype
bf16|fp16|fp32`` runs the tool inside :func:`merge_loading_in`, which hands that call the dtype
asked instead and is undone after. Not in ``compat.apply()``. Written against xtuner 0.2.0 and
transformers 4.48; without ``AutoModelForCausalLM.from_pretrained`` it warns and changes nothing.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def merge_loading_in(dtype: object) -> Iterator[bool]:
    """While inside, ``AutoModelForCausalLM.from_pretrained`` loads in ``dtype``.

    Args:
        dtype: The ``torch.dtype`` every ``from_pretrained`` call of the Auto class gets as
            ``torch_dtype`` (the one merge.py passes, fp16, is replaced).

    Yields:
        True when the load is redirected; False (with a warning) when transformers has no
        such method to wrap.
    """
    import transformers

    auto = getattr(transformers, "AutoModelForCausalLM", None)
    original = getattr(auto, "from_pretrained", None)
    if original is None:
        warnings.warn(
            "xtuner-rope convert merge --dtype: transformers.AutoModelForCausalLM.from_pretrained "
            "is missing (written for transformers 4.48): the merge loads as XTuner decides (fp16).",
            stacklevel=3,
        )
        yield False
        return
    own = vars(auto).get("from_pretrained")  # the class's own attribute, if it has one

    def from_pretrained(*args, **kwargs):
        return original(*args, **{**kwargs, "torch_dtype": dtype})

    auto.from_pretrained = staticmethod(from_pretrained)
    try:
        yield True
    finally:
        if own is None:  # inherited: drop the wrapper
            del auto.from_pretrained
        else:
            auto.from_pretrained = own


__all__ = ["merge_loading_in"]
