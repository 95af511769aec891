"""XTuner ``LLaVAModel`` patch: the sequence the LLM sees after image expansion is checked."""

from __future__ import annotations

import functools


def patch_llava_expansion_check(model, max_position: int | None) -> bool:
    """Check the sequence a LLaVA model's LLM really sees, after the image expansion.

    xtuner 0.2.0 ``LLaVAModel.forward`` replaces each image placeholder by the image's patch
    embeddings in ``prepare_inputs_labels_for_multimodal`` (a module global of
    ``xtuner.model.llava``) and rebuilds ``attention_mask`` and ``position_ids`` there: the
    per-batch checks before the forward never see that sequence (a row of image tokens past
    the RoPE range got no message). Wraps that function (once) so its output goes through
    ``xtuner_rope.models.llava.check_expanded_batch``; ``max_position`` is updated per call.

    Returns:
        True if ``model`` holds a ``LLaVAModel`` (the check is on), else False.
    """
    if not any(type(m).__name__ == "LLaVAModel" for m in model.modules()):
        return False
    import xtuner.model.llava as llava

    from xtuner_rope.models.llava import check_expanded_batch, restart_after_expansion

    current = llava.prepare_inputs_labels_for_multimodal
    original = getattr(current, "__wrapped__", current)

    @functools.wraps(original)
    def checked(llm, **kwargs):
        out = original(llm=llm, **kwargs)
        if kwargs.get("pixel_values") is not None:
            check_expanded_batch(out, checked.max_position)
            # Packed rows (llava_collate_fn): positions restart per sample, boundaries expanded.
            out = restart_after_expansion(
                out,
                kwargs["input_ids"],
                kwargs.get("attention_mask"),
                kwargs["pixel_values"].shape[1],
            )
        return out

    checked.max_position = max_position
    llava.prepare_inputs_labels_for_multimodal = checked
    if current is original:
        from mmengine.logging import print_log

        print_log(
            "xtuner-rope: LLaVAModel: the sequence its LLM sees after the image expansion "
            f"is checked every step (attended tokens, positions < {max_position}).",
            logger="current",
        )
    return True
