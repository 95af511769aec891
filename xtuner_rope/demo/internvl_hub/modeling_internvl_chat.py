"""Tiny InternVL chat model: InternViT, pixel shuffle, ``mlp1`` projector and an LLM.

Stands in for the hub's InternVL2 remote code (not downloadable here), written for
xtuner-rope. What XTuner 0.2.0 uses keeps the hub's names and meaning: ``vision_model``
(``InternVisionModel``), ``language_model`` (``InternLM2ForCausalLM`` from the copied remote
code, or transformers' ``Phi3ForCausalLM``), ``mlp1``, ``extract_feature`` and
``img_context_token_id`` (set by XTuner after loading). ``forward`` does what XTuner's
``InternVL_V1_5._llm_forward`` does (XTuner calls its own copy, not this one); the hub's
``chat`` / ``batch_chat`` / ``generate`` are not provided (XTuner's training never calls them).
"""

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_internvl_chat import InternVLChatConfig
from .modeling_intern_vit import InternVisionModel
from .modeling_internlm2 import InternLM2ForCausalLM


def pixel_shuffle(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Fold each ``r x r`` block of patches into one token (``r = 1 / scale``).

    Args:
        x: ``[n, side, side, c]`` patch features of ``n`` tiles.
        scale: ``downsample_ratio`` (0.5: 4 patches per token).

    Returns:
        ``[n, (side / r) ** 2, c * r * r]``.
    """
    r = round(1 / scale)
    n, side, _, c = x.shape
    x = x.view(n, side // r, r, side // r, r, c)  # [n, h', r, w', r, c]
    x = x.permute(0, 1, 3, 2, 4, 5)  # [n, h', w', r, r, c]
    return x.reshape(n, (side // r) ** 2, c * r * r)  # [n, h' * w', c * r * r]


class InternVLChatModel(PreTrainedModel):
    config_class = InternVLChatConfig
    main_input_name = "pixel_values"
    base_model_prefix = "language_model"
    supports_gradient_checkpointing = True
    _supports_flash_attn_2 = True
    _no_split_modules = ["InternVisionModel", "InternLM2DecoderLayer", "Phi3DecoderLayer"]

    def __init__(self, config: InternVLChatConfig, vision_model=None, language_model=None):
        super().__init__(config)
        vit = config.vision_config
        self.select_layer = config.select_layer
        self.downsample_ratio = config.downsample_ratio
        self.ps_version = config.ps_version
        self.template = config.template
        self.num_image_token = int(
            (config.force_image_size // vit.patch_size) ** 2 * config.downsample_ratio**2
        )
        self.vision_model = vision_model or InternVisionModel(vit)
        if language_model is not None:
            self.language_model = language_model
        elif config.llm_config.architectures[0] == "InternLM2ForCausalLM":
            self.language_model = InternLM2ForCausalLM(config.llm_config)
        else:
            from transformers import Phi3ForCausalLM

            self.language_model = Phi3ForCausalLM(config.llm_config)
        folded = vit.hidden_size * round(1 / config.downsample_ratio) ** 2
        llm_hidden = config.llm_config.hidden_size
        self.mlp1 = nn.Sequential(
            nn.LayerNorm(folded),
            nn.Linear(folded, llm_hidden),
            nn.GELU(),
            nn.Linear(llm_hidden, llm_hidden),
        )
        self.img_context_token_id = None

    def extract_feature(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Vision tokens of each tile, projected into the LLM's space.

        Args:
            pixel_values: ``[n, 3, H, H]`` tiles (``H = force_image_size``).

        Returns:
            ``[n, num_image_token, d]``, ``d`` the LLM's hidden size.
        """
        if self.select_layer == -1:
            feats = self.vision_model(pixel_values=pixel_values, return_dict=True).last_hidden_state
        else:
            feats = self.vision_model(
                pixel_values=pixel_values, output_hidden_states=True, return_dict=True
            ).hidden_states[self.select_layer]
        feats = feats[:, 1:, :]  # [n, side * side, c]: the class token dropped
        n, patches, c = feats.shape
        side = int(patches**0.5)
        feats = pixel_shuffle(feats.reshape(n, side, side, c), self.downsample_ratio)
        return self.mlp1(feats)

    def forward(
        self,
        pixel_values,
        input_ids,
        attention_mask=None,
        position_ids=None,
        image_flags=None,
        labels=None,
        **kwargs,
    ):
        """The LLM on ``input_ids`` with each ``img_context_token_id`` replaced by a vision
        token of the tiles whose ``image_flags`` is 1, in order (XTuner's ``_llm_forward``)."""
        embeds = self.language_model.get_input_embeddings()(input_ids).clone()
        vit = self.extract_feature(pixel_values)
        if image_flags is not None:
            vit = vit[image_flags.reshape(-1) == 1]
        selected = input_ids == self.img_context_token_id
        embeds[selected] = vit.reshape(-1, embeds.shape[-1]).to(embeds.dtype)
        out = self.language_model(
            inputs_embeds=embeds,
            attention_mask=attention_mask,
            position_ids=position_ids,
            labels=labels,
            **kwargs,
        )
        return CausalLMOutputWithPast(loss=out.loss, logits=out.logits)
