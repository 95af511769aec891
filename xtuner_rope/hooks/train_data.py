"""Before the first step: the whole training data checked, not batch by batch.

``PackedBatchCheckHook.before_train`` calls :func:`check_train_data`: a LLaVA run goes to
``data.llava_dataset_checks``, a preference run to ``data.preference_checks``.
"""

from __future__ import annotations

from xtuner_rope.config.llava_tower import image_tokens_from_config
from xtuner_rope.data.llava_dataset_checks import check_llava_dataset
from xtuner_rope.data.preference_checks import check_preference_dataset


def _row_capacity(collate_fn) -> int | None:
    """``max_length`` of a ``llava_collate_fn`` (MMEngine binds it with ``functools.partial``)."""
    func = getattr(collate_fn, "func", collate_fn)
    if getattr(func, "__name__", None) != "llava_collate_fn":
        return None
    return getattr(collate_fn, "keywords", {}).get("max_length")


def check_llava_train_data(runner, max_position: int | None) -> None:
    """Refuse a LLaVA run whose training data would fail or train silently wrong (a model without
    XTuner's ``LLaVAModel`` is left alone); ``max_position``: ``PackedBatchCheckHook``'s limit.

    Raises:
        ValueError: see :func:`xtuner_rope.data.llava_dataset_checks.check_llava_dataset`.
    """
    llava = next((m for m in runner.model.modules() if type(m).__name__ == "LLaVAModel"), None)
    loader = getattr(runner, "train_dataloader", None)
    dataset = getattr(loader, "dataset", None)
    if llava is None or not hasattr(dataset, "text_data"):
        return
    tower = image_tokens_from_config(llava.visual_encoder.config, "model.visual_encoder")
    check_llava_dataset(
        dataset, tower["image_tokens"], _row_capacity(loader.collate_fn), max_position
    )


def check_train_data(runner, max_position: int | None) -> None:
    """Refuse a run whose training data would fail or train silently wrong (see the module).

    Raises:
        ValueError: the problems found, each naming its samples (pairs) and the fix.
    """
    check_llava_train_data(runner, max_position)
    dataset = getattr(getattr(runner, "train_dataloader", None), "dataset", None)
    if dataset is not None:
        check_preference_dataset(dataset)
