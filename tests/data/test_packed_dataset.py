"""Offline packing (xtuner_rope.data.packed_dataset): every dialogue whole, nothing dropped.

References are live: the dialogues themselves (each packed document must be one of them,
each once), XTuner's ``Packer`` mapped in one stream (``map_num_proc=1``) for the opt-out's
cut packs, and XTuner's ``process_hf_dataset`` on the stock alpaca config (unpacked, and
packed with its defaults) for what must be kept.
"""

from pathlib import Path

import numpy as np
import pytest
import stock_configs as sc
from datasets import Dataset
from mmengine.config import Config
from xtuner.dataset import huggingface as xtuner_hf
from xtuner.dataset.utils import Packer
from xtuner.registry import BUILDER

from xtuner_rope.config import startup
from xtuner_rope.data.pack_plans import cut_plan
from xtuner_rope.data.packed_dataset import pack_dataset

FULL = "internlm2_chat_1_8b_full_alpaca_e3"


def _dialogues(lengths, seed: int = 0) -> Dataset:
    rng = np.random.default_rng(seed)
    return Dataset.from_list(
        [
            {
                "input_ids": rng.integers(0, 500, n).tolist(),
                "labels": rng.integers(-100, 500, n).tolist(),
            }
            for n in lengths
        ]
    )


def _xtuner_one_stream(dataset: Dataset, max_length: int, varlen: bool) -> Dataset:
    """XTuner's Packer over the whole dataset in one process (its map batches of 1000)."""
    return dataset.map(
        Packer(max_length, use_varlen_attn=varlen),
        batched=True,
        num_proc=1,
        remove_columns=dataset.column_names,
    )


@pytest.mark.parametrize("varlen", [True, False])
@pytest.mark.parametrize(
    "n, max_length, seed",
    [
        (1, 7, 0),
        (37, 1, 1),
        (999, 64, 2),
        (1000, 50, 3),
        (2345, 97, 4),
        (3001, 4096, 5),
        (2500, 3, 6),
    ],
)
def test_the_cut_opt_out_packs_xtuners_one_stream_packs_plus_the_leftover(
    n, max_length, seed, varlen
):
    lengths = np.random.default_rng(seed).integers(1, 90, n)
    data = _dialogues(lengths, seed)
    ref = _xtuner_one_stream(data, max_length, varlen)
    ours = pack_dataset(data, max_length, varlen, False, 1, whole=False)
    assert ours.column_names == ref.column_names
    assert ours.features == ref.features
    for column in ref.column_names:
        assert ours[column][: len(ref)] == ref[column], column
    kept = sum(map(len, ours["input_ids"]))
    assert kept == lengths.sum()
    assert len(ours) - len(ref) == (1 if kept > sum(map(len, ref["input_ids"])) else 0)
    if varlen:  # the kept leftover row has XTuner's boundary format too
        last = ours[-1]
        bounds = last["cumulative_len"]
        assert bounds[0] == 0 and bounds[-1] == len(last["input_ids"]) <= max_length
        starts = np.repeat(bounds[:-1], np.diff(bounds))
        assert last["position_ids"] == (np.arange(bounds[-1]) - starts).tolist()


def test_where_xtuner_loses_nothing_the_packs_are_the_same():
    data = _dialogues([16] * 3000)  # 3 batches of whole 64-token rows: no leftover
    ref = _xtuner_one_stream(data, 64, True)
    ours = pack_dataset(data, 64, True, False, 1, whole=False)
    assert ours.to_dict() == ref.to_dict()


def test_plan_of_nothing_and_bad_max_length():
    assert cut_plan(np.zeros(0, dtype=np.int64), 8).tolist() == [0]
    with pytest.raises(
        ValueError,
        match=r"max_length must be a positive integer, got 0; set "
        r"max_length in PART 1",
    ):
        cut_plan(np.array([3, 4]), 0)


def test_untokenized_dataset_is_refused_with_its_columns():
    with pytest.raises(
        ValueError,
        match=r"no column\(s\) \['labels'\] \(columns: "
        r"\['input_ids'\]\); pack_to_max_length needs tokenized",
    ):
        pack_dataset(Dataset.from_dict({"input_ids": [[1, 2]]}), 8, True, False, 1)


def _stock_config(tmp_path: Path, n: int, map_num_proc: int | None = 1) -> Path:
    """The stock alpaca config with the one edit, its max_length (2048) kept, on n dialogues
    (``map_num_proc=None``: XTuner's 32 map processes, each dropping its shard's leftover)."""
    copy = sc.copy_stock(FULL, tmp_path)
    data = sc.write_alpaca_data(tmp_path / "alpaca", n=n)
    text = sc.enable_plugin(sc.localize(copy, data, map_num_proc=map_num_proc))
    text = sc.sub_once(text, r"^max_length = 512$", "max_length = 2048")
    path = tmp_path / "alpaca.py"
    path.write_text(text)
    return path


def _build(path: Path, plugin: bool, pack: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """``[t]`` token ids and labels of the config's train dataset, rows concatenated."""
    cfg = Config.fromfile(str(path))
    cfg.train_dataloader.dataset.pack_to_max_length = pack
    if plugin:
        for finding in startup.inspect_config(cfg):
            if finding.fix is not None:
                finding.fix()
    dataset = BUILDER.build(cfg.train_dataloader.dataset)
    return tuple(
        np.concatenate([np.asarray(r, dtype=np.int64) for r in dataset[column]])
        for column in ("input_ids", "labels")
    )


def _histogram(values: np.ndarray) -> np.ndarray:
    return np.bincount(values[values != -100], minlength=100_000)


@pytest.mark.slow
def test_stock_alpaca_dataset_keeps_every_token_and_label(tmp_path):
    """2,400 dialogues, max_length 2048, map_num_proc 32: XTuner drops shard leftovers."""
    sc.ensure_tiny_model()
    path = _stock_config(tmp_path, 2400, map_num_proc=None)
    tokens, labels = _build(path, plugin=False, pack=False)
    xtuner_tokens, xtuner_labels = _build(path, plugin=False)
    ours_tokens, ours_labels = _build(path, plugin=True)
    assert xtuner_hf.pack_dataset.__module__ == "xtuner.dataset.huggingface"  # restored
    print(
        f"unpacked {len(tokens)} tokens / {(labels != -100).sum()} labels; XTuner packed "
        f"{len(xtuner_tokens)} / {(xtuner_labels != -100).sum()}; lossless "
        f"{len(ours_tokens)} / {(ours_labels != -100).sum()}"
    )
    assert len(xtuner_tokens) < 0.9 * len(tokens)  # XTuner alone loses them
    assert (xtuner_labels != -100).sum() < (labels != -100).sum()
    # Every token id and every supervised label, as many times as in the unpacked dataset.
    np.testing.assert_array_equal(
        np.bincount(ours_tokens, minlength=100_000), np.bincount(tokens, minlength=100_000)
    )
    np.testing.assert_array_equal(_histogram(ours_labels), _histogram(labels))


def _documents_of(dataset) -> list[tuple[tuple, tuple]]:
    """``(ids, labels)`` of every document of every packed row, cut at its ``cumulative_len``."""
    docs = []
    for ids, labels, bounds in zip(
        dataset["input_ids"], dataset["labels"], dataset["cumulative_len"]
    ):
        docs += [(tuple(ids[a:b]), tuple(labels[a:b])) for a, b in zip(bounds[:-1], bounds[1:])]
    return docs


def test_xtuners_own_pipeline_packs_every_dialogue_whole_and_once(tmp_path):
    """The stock alpaca config with the one edit, 600 dialogues, max_length 512.

    Reference: XTuner's own unpacked dataset (``pack_to_max_length=False``). Every document of
    the packed rows is one of its dialogues (ids and labels equal), each exactly once; what
    the model receives through the config's collate function is the same documents, each
    one's first label ignored (the causal shift would predict it from the previous document).
    """
    from collections import Counter

    from xtuner.dataset.collate_fns import default_collate_fn

    sc.ensure_tiny_model()
    copy = sc.copy_stock(FULL, tmp_path)
    data = sc.write_alpaca_data(tmp_path / "alpaca", n=600)
    path = tmp_path / "alpaca.py"
    path.write_text(sc.enable_plugin(sc.localize(copy, data)))
    cfg = Config.fromfile(str(path))
    assert cfg.max_length == 512 and cfg.train_dataloader.dataset.shuffle_before_pack
    unpacked_cfg = Config.fromfile(str(path))
    unpacked_cfg.train_dataloader.dataset.pack_to_max_length = False
    unpacked = BUILDER.build(unpacked_cfg.train_dataloader.dataset)
    for finding in startup.inspect_config(cfg):
        if finding.fix is not None:
            finding.fix()
    packed = BUILDER.build(cfg.train_dataloader.dataset)
    dialogues = Counter(zip(map(tuple, unpacked["input_ids"]), map(tuple, unpacked["labels"])))
    assert len(unpacked) == 600 and max(map(len, packed["input_ids"])) <= 512
    assert Counter(_documents_of(packed)) == dialogues  # whole, once, none lost or added
    tokens = sum(map(len, unpacked["input_ids"]))
    assert tokens / (len(packed) * 512) >= 0.95  # fill on this small set
    # What the model receives: the stock default_collate_fn (use_varlen_attn set by the fixes).
    seen = Counter()
    for i in range(len(packed)):
        batch = default_collate_fn([packed[i]], use_varlen_attn=True)["data"]
        ids, labels = batch["input_ids"][0].tolist(), batch["labels"][0].tolist()
        bounds = batch["cumulative_len"][0].tolist()
        positions = batch["position_ids"][0].tolist()
        for a, b in zip(bounds[:-1], bounds[1:]):
            assert positions[a:b] == list(range(b - a))
            seen[(tuple(ids[a:b]), (-100, *labels[a + 1 : b]))] += 1
    first_ignored = Counter(
        {(ids, (-100, *labels[1:])): k for (ids, labels), k in dialogues.items()}
    )
    assert seen == first_ignored
