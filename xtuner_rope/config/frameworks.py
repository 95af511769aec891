"""Start-up findings on the training framework: XTuner's Hugging Face ``Trainer`` configs.

With ``framework = "huggingface"`` (its ``*_hf`` stock configs) XTuner trains with
transformers' ``Trainer``: the config's hooks and collate function never run. Refused before
the weights load, with the MMEngine config to use instead.
"""

from __future__ import annotations

from mmengine.config import Config

from xtuner_rope.compat.mmengine_config import config_dict

from .findings import Finding
from .startup import register_findings


@register_findings("framework")
def huggingface_trainer_findings(cfg: Config) -> list[Finding]:
    """A conflict for ``framework = "huggingface"``; nothing for MMEngine configs."""
    framework = config_dict(cfg).get("framework", "mmengine")
    if str(framework).lower() != "huggingface":
        return []
    packs = config_dict(cfg).get("pack_to_max_length", False)
    what = (
        " (pack_to_max_length=True: its packed documents would attend to each other)"
        if packs
        else ""
    )
    return [
        Finding(
            "framework",
            f"{framework!r}: XTuner trains this config with transformers' Trainer, which runs "
            f"no MMEngine hook and no collate function of the config, so xtuner-rope's batch "
            f"checks and document isolation would not run{what}",
            "train with XTuner's MMEngine config of the same recipe (the stock name without "
            "'_hf', e.g. llama2_70b_qlora_open_platypus_e1), or remove model_resource = "
            "dict(fn=enable_xtuner_rope) to train without xtuner-rope",
        )
    ]
