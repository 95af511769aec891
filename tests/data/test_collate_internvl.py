"""``internvl_collate_fn`` on hand-made InternVL samples: rows, tiles, boundaries, errors."""

import pytest
import torch

from xtuner_rope.batch.internvl_tiles import check_image_context
from xtuner_rope.data.collate_internvl import internvl_collate_fn

CONTEXT, P = 7, 4  # <IMG_CONTEXT> id, tokens per tile


def _sample(n_text: int, tiles: int = 0) -> dict:
    """``tiles`` image tiles (``P`` context ids each) then ``n_text`` ids; text-only: a zero tile."""
    ids = [CONTEXT] * (P * tiles) + list(range(10, 10 + n_text))
    labels = [-100] * (len(ids) - n_text) + ids[len(ids) - n_text :]
    pixels = torch.rand(tiles, 3, 8, 8) + 0.1 if tiles else torch.zeros(1, 3, 8, 8)
    return {"input_ids": ids, "labels": labels, "pixel_values": pixels}


def test_packs_whole_samples_with_tiles_in_sample_order():
    batch = [_sample(5, tiles=2), _sample(3), _sample(6, tiles=1), _sample(2)]
    data = internvl_collate_fn(batch, max_length=64, return_hf_format=True)
    assert data["input_ids"].shape[0] == 1  # 13 + 3 + 10 + 2 tokens in one row
    cu = data["cumulative_len"][0].tolist()
    assert cu == [0, 13, 16, 26, 28]
    assert data["position_ids"][0].tolist() == [*range(13), *range(3), *range(10), *range(2)]
    # The row's tiles in sample order: 2 image tiles, the zero tile, 1 tile, the zero tile.
    tiles = data["pixel_values"][0]
    assert tiles.shape[0] == 5
    for t, sample_tile in zip(tiles, [batch[0]["pixel_values"][0], batch[0]["pixel_values"][1],
                                      batch[1]["pixel_values"][0], batch[2]["pixel_values"][0],
                                      batch[3]["pixel_values"][0]]):  # fmt: skip
        assert torch.equal(t, sample_tile)
    assert (data["labels"][0, [0, 13, 16, 26]] == -100).all()  # never predicted across samples
    assert check_image_context(data, CONTEXT, P) == [12]


def test_unpacked_rows_are_xtuner_padding_with_boundaries():
    batch = [_sample(5, tiles=1), _sample(3)]
    data = internvl_collate_fn(batch, max_length=64, pack=False, return_hf_format=True)
    assert data["input_ids"].shape == (2, 9)
    assert data["attention_mask"].sum(dim=1).tolist() == [9, 3]
    assert [c.tolist() for c in data["cumulative_len"]] == [[0, 9], [0, 3, 9]]
    assert check_image_context(data, CONTEXT, P) == [4, 0]


def test_sample_over_max_length_is_named():
    with pytest.raises(ValueError, match=r"sample 1: 13 tokens \(image tokens included\), over "):
        internvl_collate_fn([_sample(2), _sample(5, tiles=2)], max_length=12)


def test_not_an_internvl_item_is_named():
    with pytest.raises(TypeError, match="sample 0: expected a dict with input_ids, labels and "):
        internvl_collate_fn([{"input_ids": [1], "labels": [1]}], max_length=8)


def test_all_unsupervised_batch_is_refused():
    sample = {"input_ids": [1, 2], "labels": [-100, -100], "pixel_values": torch.zeros(1, 3, 8, 8)}
    with pytest.raises(ValueError, match="have no supervised label"):
        internvl_collate_fn([sample], max_length=8)


def test_image_tokens_cut_by_max_length_are_named_with_the_row():
    """The dataset's ``max_length`` cut into an image's context tokens: XTuner would write the
    wrong vision tokens; the check names the row before the step."""
    cut = _sample(1, tiles=2)
    cut["input_ids"], cut["labels"] = cut["input_ids"][:6], cut["labels"][:6]
    cut["labels"][-1] = 5
    data = internvl_collate_fn([_sample(3), cut], max_length=64, pack=False, return_hf_format=True)
    with pytest.raises(ValueError, match=r"row 1, field 'input_ids': 6 <IMG_CONTEXT> token\(s\)"):
        check_image_context(data, CONTEXT, P)
