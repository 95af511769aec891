"""transformers patches for InternLM2: Auto-class registration and generation from ``inputs_embeds``."""

from __future__ import annotations

import functools
import inspect
import sys


def register_internlm2_auto_classes() -> bool:
    """Register XTuner 0.2.0's shipped InternLM2 classes with the ``transformers`` Auto factories
    (transformers 4.48 has no ``internlm2`` type: a local checkpoint without remote code would not
    load); False if ``internlm2`` was already known.
    """
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if "internlm2" in CONFIG_MAPPING:
        return False
    from xtuner._lite.modelings.internlm2.configuration_internlm2 import InternLM2Config
    from xtuner._lite.modelings.internlm2.modeling_internlm2 import (
        InternLM2ForCausalLM,
        InternLM2Model,
    )

    AutoConfig.register("internlm2", InternLM2Config)
    AutoModel.register(InternLM2Config, InternLM2Model)
    AutoModelForCausalLM.register(InternLM2Config, InternLM2ForCausalLM)
    return True


_EMBEDS_ONLY_WITHOUT_CACHE = "inputs_embeds is not None and past_key_values is None"


def _is_empty_cache(past_key_values) -> bool:
    from transformers.cache_utils import Cache

    return isinstance(past_key_values, Cache) and past_key_values.get_seq_length() == 0


def _fix_generation_from_embeds(cls: type) -> bool:
    """Wrap ``cls.prepare_inputs_for_generation`` if it has the InternLM2 gap; True if wrapped."""
    method = cls.__dict__.get("prepare_inputs_for_generation")
    if method is None or getattr(method, "_xtuner_rope_embeds", False):
        return False
    try:
        source = inspect.getsource(method)
    except (OSError, TypeError):
        return False
    if _EMBEDS_ONLY_WITHOUT_CACHE not in source:
        return False

    @functools.wraps(method)
    def prepare_inputs_for_generation(
        self, input_ids, past_key_values=None, attention_mask=None, inputs_embeds=None, **kwargs
    ):
        out = method(
            self,
            input_ids,
            past_key_values=past_key_values,
            attention_mask=attention_mask,
            inputs_embeds=inputs_embeds,
            **kwargs,
        )
        if (
            inputs_embeds is not None
            and "inputs_embeds" not in out
            and _is_empty_cache(past_key_values)
        ):
            out.pop("input_ids", None)  # the empty [b, 0] ids generate() starts from
            out["inputs_embeds"] = inputs_embeds
        return out

    prepare_inputs_for_generation._xtuner_rope_embeds = True
    cls.prepare_inputs_for_generation = prepare_inputs_for_generation
    return True


def _internlm2_causal_lm_classes(module) -> list[type]:
    return [
        v
        for k, v in vars(module).items()
        if isinstance(v, type) and k.startswith("InternLM2") and k.endswith("ForCausalLM")
    ]


def patch_internlm2_generation_from_embeds() -> bool:
    """Let InternLM2's modeling code generate from ``inputs_embeds`` under transformers 4.48.0.

    ``generate()`` hands the first step an empty ``DynamicCache``, and InternLM2's
    ``prepare_inputs_for_generation`` feeds ``inputs_embeds`` only without a cache: the empty ids
    go in and the model dies (XTuner's ``EvaluateChatHook`` with ``evaluation_images``). The step
    gets its ``inputs_embeds`` while the cache is empty, in XTuner's copies now and in remote-code
    classes when ``transformers`` loads them.
    """
    import transformers.dynamic_module_utils as dynamic

    original = dynamic.get_class_in_module

    @functools.wraps(original)
    def get_class_in_module(class_name, module_path, *args, **kwargs):
        cls = original(class_name, module_path, *args, **kwargs)
        for candidate in _internlm2_causal_lm_classes(sys.modules.get(cls.__module__, cls)):
            _fix_generation_from_embeds(candidate)
        return cls

    dynamic.get_class_in_module = get_class_in_module
    for name, loaded in list(sys.modules.items()):  # already loaded: XTuner's copies, remote code
        if loaded is not None and "internlm2" in name.lower() and "modeling" in name:
            for cls in _internlm2_causal_lm_classes(loaded):
                _fix_generation_from_embeds(cls)
    import xtuner._lite.modelings.internlm2.modeling_internlm2 as shipped

    for cls in _internlm2_causal_lm_classes(shipped):
        _fix_generation_from_embeds(cls)
    return True
