"""The packed rows are saved beside the tokenized dataset's cache and reused on the next start."""

from pathlib import Path

import numpy as np
from datasets import Dataset

from xtuner_rope.data.packed_dataset import pack_dataset


def _dialogues(seed: int = 0, n: int = 300) -> Dataset:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 60, n)
    return Dataset.from_dict(
        {
            "input_ids": [rng.integers(1, 500, k).tolist() for k in lengths],
            "labels": [rng.integers(-100, 500, k).tolist() for k in lengths],
        }
    )


def _file(packed: Dataset) -> str:
    return packed.cache_files[0]["filename"]


def test_the_same_dialogues_seed_and_arguments_reuse_the_packed_file():
    data = _dialogues()
    np.random.seed(3)
    first = pack_dataset(data, 100, True, True, 1)
    np.random.seed(3)
    again = pack_dataset(data, 100, True, True, 1)
    assert _file(again) == _file(first)
    np.random.seed(4)  # another shuffle, another max_length, varlen or not: other files
    assert _file(pack_dataset(data, 100, True, True, 1)) != _file(first)
    np.random.seed(3)
    assert _file(pack_dataset(data, 101, True, True, 1)) != _file(first)
    np.random.seed(3)
    assert _file(pack_dataset(data, 100, False, True, 1)) != _file(first)


def test_rows_planned_again_are_the_same_as_those_saved():
    # The saved file moved away: the rows are planned and written again, and come out equal.
    np.random.seed(5)
    first = pack_dataset(_dialogues(1), 100, True, True, 1)
    saved = Path(_file(first))
    kept = saved.rename(saved.with_suffix(".kept"))
    np.random.seed(5)
    fresh = pack_dataset(_dialogues(1), 100, True, True, 1)
    assert Path(_file(fresh)) == saved and saved.exists()
    assert (
        Dataset.from_file(str(kept)).with_format("arrow")[:].equals(fresh.with_format("arrow")[:])
    )
