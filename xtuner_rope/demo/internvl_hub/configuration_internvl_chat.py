"""Config of the tiny InternVL chat model (stands in for the hub's InternVL2 remote code).

The fields XTuner 0.2.0 reads (``InternVL_V1_5``, ``InternVL_V1_5_Dataset``) keep the hub's
names and meaning: ``vision_config`` (InternViT), ``llm_config`` (the LLM's own config, with
its ``architectures``), ``template``, ``downsample_ratio`` (pixel-shuffle scale: each tile's
``(force_image_size / patch_size) ** 2`` patches become that times ``downsample_ratio ** 2``
tokens), ``force_image_size`` (tile side in pixels), ``select_layer`` (the InternViT layer
whose features are used, -1 the last), ``dynamic_image_size`` / ``min_dynamic_patch`` /
``max_dynamic_patch`` / ``use_thumbnail`` (the tiling of an image) and ``ps_version``.
"""

import copy

from transformers import PretrainedConfig

from .configuration_intern_vit import InternVisionConfig
from .configuration_internlm2 import InternLM2Config


def _llm_config(llm_config: dict) -> PretrainedConfig:
    architecture = (llm_config.get("architectures") or ["InternLM2ForCausalLM"])[0]
    if architecture == "InternLM2ForCausalLM":
        return InternLM2Config(**llm_config)
    if architecture == "Phi3ForCausalLM":
        from transformers import Phi3Config

        return Phi3Config(**llm_config)
    raise ValueError(
        f"InternVLChatConfig: llm_config.architectures[0] = {architecture!r}: this tiny "
        "stand-in builds InternLM2ForCausalLM or Phi3ForCausalLM only."
    )


class InternVLChatConfig(PretrainedConfig):
    model_type = "internvl_chat"
    is_composition = True

    def __init__(
        self,
        vision_config=None,
        llm_config=None,
        use_backbone_lora=0,
        use_llm_lora=0,
        select_layer=-1,
        force_image_size=None,
        downsample_ratio=0.5,
        template=None,
        dynamic_image_size=False,
        use_thumbnail=False,
        ps_version="v2",
        min_dynamic_patch=1,
        max_dynamic_patch=6,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.vision_config = InternVisionConfig(**(vision_config or {}))
        self.llm_config = _llm_config(dict(llm_config or {}))
        self.use_backbone_lora = use_backbone_lora
        self.use_llm_lora = use_llm_lora
        self.select_layer = select_layer
        self.force_image_size = force_image_size or self.vision_config.image_size
        self.downsample_ratio = downsample_ratio
        self.template = template
        self.dynamic_image_size = dynamic_image_size
        self.use_thumbnail = use_thumbnail
        self.ps_version = ps_version
        self.min_dynamic_patch = min_dynamic_patch
        self.max_dynamic_patch = max_dynamic_patch
        self.tie_word_embeddings = self.llm_config.tie_word_embeddings

    def to_dict(self):
        out = copy.deepcopy(self.__dict__)
        out["vision_config"] = self.vision_config.to_dict()
        out["llm_config"] = self.llm_config.to_dict()
        out["model_type"] = self.__class__.model_type
        return out
