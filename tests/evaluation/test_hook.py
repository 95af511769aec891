"""``HeldOutCurvesHook``: the checks of a built run, and the curves' PNG."""

from types import SimpleNamespace

import pytest
from datasets import Dataset
from matplotlib.image import imread

from xtuner_rope.evaluation.hook import check_heldout_run, draw_curves, supervised_labels


def _runner(labels: list[list[int]], val_interval: int = 4, max_iters: int = 8):
    dataset = Dataset.from_dict({"input_ids": labels, "labels": labels})
    return SimpleNamespace(
        train_loop=SimpleNamespace(val_interval=val_interval, max_iters=max_iters),
        val_loop=SimpleNamespace(dataloader=SimpleNamespace(dataset=dataset)),
    )


def test_supervised_labels_are_counted():
    assert supervised_labels(Dataset.from_dict({"labels": [[-100, 3, 4], [-100, -100]]})) == 2


def test_a_heldout_set_without_supervised_tokens_is_refused():
    with pytest.raises(ValueError, match=r"held-out set \(2 rows\) has no supervised token"):
        check_heldout_run(_runner([[-100, -100], [-100]]))
    check_heldout_run(_runner([[-100, 5]]))  # one supervised token is enough


def test_the_curves_are_a_png(tmp_path):
    path = tmp_path / "curves.png"
    draw_curves([(1, 3.0), (2, 2.5), (3, 2.2)], [(2, 2.7), (3, 2.4)], path)
    image = imread(path)
    assert image.ndim == 3 and image.std() > 0
