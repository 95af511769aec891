"""The doctor's loss-weight figure, against the weights written out by hand."""

import pytest

from xtuner_rope.doctor.loss_weights import (
    dataset_loss_weights,
    loss_weight_line,
    token_weight_figures,
)


def test_factors_against_weights_by_hand():
    # Window 1: micro-batches of 10 and 30 supervised tokens (N = 40, a = 2): XTuner weighs a
    # token 1/(2*10) and 1/(2*30), the token-weighted loss 1/40: factors 2.0 and 0.667.
    # Window 2 (incomplete, a = 1): 5 tokens, factor 1.
    figures = token_weight_figures([[4, 6], [30], [5]], dialogues=[2, 1, 1], accumulation=2)
    assert figures["max_over_min"] == pytest.approx(2.0 / (40 / 60))
    assert figures["changed_2x_share"] == 0.0  # 2.0 is not more than 2x
    figures = token_weight_figures([[4, 5], [30], [5]], dialogues=[2, 1, 1], accumulation=2)
    assert figures["changed_2x_share"] == pytest.approx(2 / 4)  # 39 / 18 > 2: both dialogues
    assert figures["windows"] == 2 and figures["micro_batches"] == 3


def test_a_micro_batch_without_labels_has_no_factor_but_counts_in_its_window():
    figures = token_weight_figures([[5], [0]], dialogues=[1, 1], accumulation=2)
    assert figures["max_over_min"] == 1.0  # only [5]: factor 5 / (2 * 5) = 0.5
    assert figures["changed_2x_share"] == 0.0


def test_one_micro_batch_per_step_changes_nothing():
    figures = token_weight_figures([[3, 9], [40]], dialogues=[2, 1], accumulation=1)
    assert figures["max_over_min"] == 1.0 and figures["changed_2x_share"] == 0.0


def test_packed_rows_count_their_dialogues():
    rows = [{"cumulative_len": [0, 5, 9, 20]}, {"cumulative_len": [0, 7]}, {}]
    figures = dataset_loss_weights(rows, [10, 40, 10], batch_size=1, accumulation=3, max_batches=10)
    # N = 60, a = 3: factors 2, 0.5, 2; the 3 dialogues of row 0 and the one of row 2 changed
    # by exactly 2x (not more).
    assert figures["max_over_min"] == pytest.approx(4.0)
    assert figures["changed_2x_share"] == 0.0
    assert "max/min per-token weight 4.00x" in loss_weight_line(figures)[0]
    assert loss_weight_line(None) == []
