"""Intern-repo packing (``build_whole_packed_dataset``): XTuner's ``build_packed_dataset`` with
every document whole. References: the documents themselves, and XTuner's own builder (which
cuts them) on the same datasets; the start-up swaps the builder and keeps the opt-out."""

import json
import pickle
from collections import Counter

import numpy as np
import pytest
from datasets import Dataset
from mmengine.config import Config
from xtuner.dataset import intern_repo

from xtuner_rope.config.fields import type_name
from xtuner_rope.config.startup import prepare_config
from xtuner_rope.data.intern_repo_packing import build_whole_packed_dataset


def _documents(lengths, seed: int) -> Dataset:
    rng = np.random.default_rng(seed)
    rows = []
    for n in lengths:
        ids = rng.integers(1, 500, n)
        rows.append({"input_ids": ids.tolist(), "labels": np.where(ids % 3, ids, -100).tolist()})
    return Dataset.from_list(rows)


def _packed_documents(packed) -> Counter:
    docs = Counter()
    for row in packed:
        bounds, pos = row["cumulative_len"], row["position_ids"]
        assert bounds[0] == 0 and bounds[-1] == len(row["input_ids"]) == len(row["labels"])
        for a, b in zip(bounds[:-1], bounds[1:]):
            assert pos[a:b] == list(range(b - a))
            docs[(tuple(row["input_ids"][a:b]), tuple(row["labels"][a:b]))] += 1
    return docs


def _expected(datasets, packed_length: int) -> Counter:
    """Each document once; one longer than a row as its ``packed_length`` pieces."""
    want = Counter()
    for ds in datasets:
        for ids, labels in zip(ds["input_ids"], ds["labels"]):
            for k in range(0, len(ids), packed_length):
                want[(tuple(ids[k : k + packed_length]), tuple(labels[k : k + packed_length]))] += 1
    return want


@pytest.mark.parametrize("packed_length", [64, 97])
def test_every_document_whole_once_where_xtuner_cuts(packed_length):
    datasets = [
        _documents(np.random.default_rng(0).integers(1, 60, 300), 0),
        _documents([150, 3, 64, 20, 200], 1),  # pretraining-style documents over a row
    ]
    packed = build_whole_packed_dataset(datasets, packed_length=packed_length, seed=1024)
    assert intern_repo.PackedDataset.__module__ == "xtuner.dataset.intern_repo"  # restored
    rows = [packed[i] for i in range(len(packed))]
    assert max(len(r["input_ids"]) for r in rows) <= packed_length
    assert _packed_documents(rows) == _expected(datasets, packed_length)
    xtuner = intern_repo.build_packed_dataset(datasets, packed_length=packed_length, seed=1024)
    xtuner_docs = _packed_documents([xtuner[i] for i in range(len(xtuner))])
    assert xtuner_docs != _expected(datasets, packed_length)  # XTuner cuts (and drops the tail)
    tokens = sum(len(ids) for ds in datasets for ids in ds["input_ids"])
    assert len(packed) <= 1.1 * tokens / packed_length + len(datasets)


def test_same_seed_same_rows_and_the_seed_shuffles_them():
    datasets = [_documents(np.random.default_rng(2).integers(1, 40, 400), 2)]

    def rows(seed):
        packed = build_whole_packed_dataset(datasets, packed_length=80, seed=seed)
        return [packed[i]["input_ids"] for i in range(len(packed))]

    assert rows(1024) == rows(1024) and rows(1024) != rows(7)


def test_the_cut_opt_out_is_xtuners_own_packer():
    datasets = [_documents(np.random.default_rng(3).integers(1, 40, 200), 3)]
    ours = build_whole_packed_dataset(datasets, packed_length=64, seed=5, whole_documents=False)
    xtuner = intern_repo.build_packed_dataset(datasets, packed_length=64, seed=5)
    assert [ours[i] for i in range(len(ours))] == [xtuner[i] for i in range(len(xtuner))]
    with pytest.raises(TypeError, match=r"whole_documents: expected True or False, got 1"):
        build_whole_packed_dataset(datasets, whole_documents=1)


def _write_bin(folder, lengths, seed: int) -> None:
    """The intern-repo tokenized format: one JSON line a document (an unsupervised token
    negated), its ``.meta`` index of (byte offset, length), as XTuner's loader reads them."""
    rng, meta, at = np.random.default_rng(seed), [], 0
    with open(folder / "docs.bin", "wb") as out:
        for n in lengths:
            ids = rng.integers(1, 500, n)
            ids[ids % 3 == 0] *= -1
            line = (json.dumps({"tokens": ids.tolist()}) + "\n").encode()
            meta.append((at, n))
            out.write(line)
            at += len(line)
    with open(folder / "docs.bin.meta", "wb") as f:
        np.save(f, np.array(meta, dtype=np.int64))


def test_tokenized_bin_files_rows_from_xtuners_mapped_reader(tmp_path):
    _write_bin(tmp_path, [*np.random.default_rng(4).integers(1, 50, 300), 130], 4)
    cfg = dict(type=intern_repo.load_intern_repo_tokenized_dataset, folder=str(tmp_path))
    packed = build_whole_packed_dataset(cfg, packed_length=64, seed=1024)
    (source,) = intern_repo.load_intern_repo_tokenized_dataset(str(tmp_path))
    docs = [source[i] for i in range(len(source))]  # XTuner's reading: negated ids -> -100
    want = Dataset.from_dict({k: [d[k] for d in docs] for k in ("input_ids", "labels")})
    assert _packed_documents([packed[i] for i in range(len(packed))]) == _expected([want], 64)


def test_a_selected_dataset_is_read_through_its_indices():
    documents = _documents(np.random.default_rng(5).integers(1, 40, 300), 5)
    selected = documents.shuffle(seed=3).filter(lambda row: len(row["input_ids"]) % 4)
    flat = selected.flatten_indices()
    ours = build_whole_packed_dataset([selected], packed_length=70, seed=9)
    want = build_whole_packed_dataset([flat], packed_length=70, seed=9)
    assert [ours[i] for i in range(len(ours))] == [want[i] for i in range(len(want))]
    assert _packed_documents([ours[i] for i in range(len(ours))]) == _expected([flat], 70)


def test_the_broadcast_copy_holds_the_plan_and_serves_the_same_rows():
    """XTuner broadcasts rank 0's packed dataset by pickle: a read row's gather (views of
    the table) stays out of it, and the copy reads the same rows."""
    packed = build_whole_packed_dataset(
        [_documents(np.random.default_rng(6).integers(1, 40, 200), 6)], packed_length=64, seed=1
    )
    rows = [packed[i] for i in range(len(packed))]
    (packer,) = packed.datasets
    assert packer._gather is not None and pickle.loads(pickle.dumps(packer))._gather is None
    copy = pickle.loads(pickle.dumps(packed))
    assert [copy[i] for i in range(len(copy))] == rows


def _cfg(mode: str | None = None) -> Config:
    dataset = dict(
        type="build_packed_dataset",
        dataset_cfg=dict(type="load_intern_repo_tokenized_dataset", folder="/data"),
        packed_length=512,
    )
    loader = dict(
        batch_size=1,
        dataset=dataset,
        collate_fn=dict(type="default_collate_fn", use_varlen_attn=True),
    )
    return Config(
        dict(train_dataloader=loader, **({} if mode is None else {"offline_packing": mode}))
    )


def test_the_start_up_swaps_the_builder_and_the_opt_out_keeps_xtuners():
    cfg = _cfg()
    fix = {f.setting: f for f in prepare_config(cfg)}["train_dataloader.dataset.type"]
    assert fix.edit.startswith("set to build_whole_packed_dataset(whole_documents=True)")
    assert type_name(cfg.train_dataloader.dataset.type) == "build_whole_packed_dataset"
    cut = _cfg("cut")
    assert "train_dataloader.dataset.type" not in [f.setting for f in prepare_config(cut)]
    assert cut.train_dataloader.dataset.type == "build_packed_dataset"
