"""XTuner ``LLaVAModel`` patches: the sequence the LLM sees after image expansion is checked,
and ``predict`` returns the labels of that sequence (held-out evaluation)."""

from __future__ import annotations

import functools


def patch_llava_expansion_check(model, max_position: int | None) -> bool:
    """Check the sequence a LLaVA ``model``'s LLM really sees, after the image expansion.

    xtuner 0.2.0 expands each image placeholder in ``prepare_inputs_labels_for_multimodal``, where
    the batch checks never look: its output goes through ``models.llava.check_expanded_batch``
    (``max_position`` updated per call). True if ``model`` holds a ``LLaVAModel``, else False.
    """
    if not any(type(m).__name__ == "LLaVAModel" for m in model.modules()):
        return False
    import xtuner.model.llava as llava

    from xtuner_rope.models.llava import (
        check_expanded_batch,
        expanded_row_lengths,
        remember_expanded_host_copies,
        restart_after_expansion,
    )

    current = llava.prepare_inputs_labels_for_multimodal
    original = getattr(current, "__wrapped__", current)

    @functools.wraps(original)
    def checked(llm, **kwargs):
        out = original(llm=llm, **kwargs)
        if kwargs.get("pixel_values") is not None:
            # Row lengths from the host copy of the batch: the check reads nothing back.
            image_tokens = kwargs["pixel_values"].shape[1]
            lengths = expanded_row_lengths(
                kwargs["input_ids"], kwargs.get("attention_mask"), image_tokens
            )
            check_expanded_batch(out, checked.max_position, lengths)
            if lengths is not None:
                remember_expanded_host_copies(out, lengths, kwargs, image_tokens)
            # Packed rows (llava_collate_fn): positions restart per sample, boundaries expanded.
            out = restart_after_expansion(
                out,
                kwargs["input_ids"],
                kwargs.get("attention_mask"),
                image_tokens,
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


def _predict_with_labels(self, data, data_samples=None):
    """``LLaVAModel.predict`` whose rows also carry the labels of the sequence the LLM saw."""
    rows, labels = [{"logits": x} for x in self.llm(**data).logits], data.get("labels")
    return rows if labels is None else [{**r, "labels": row} for r, row in zip(rows, labels)]


def patch_llava_predict_labels() -> bool:
    """XTuner's LLaVA ``predict`` (its ``val_step``) returns each row's expanded labels too.

    xtuner 0.2.0 ``LLaVAModel.predict`` returns logits over the sequence after the image
    expansion, while the metric's batch holds the labels before it: each row's dict now holds the
    ``labels`` ``[s']`` that ``compute_loss`` uses (-100 on image tokens and padding).
    """
    from xtuner.model.llava import LLaVAModel

    if "predict" not in LLaVAModel.__dict__:  # another XTuner: leave it
        return False
    LLaVAModel.predict = _predict_with_labels
    return True
