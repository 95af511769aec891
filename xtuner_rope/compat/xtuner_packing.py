"""XTuner's offline pack steps swapped for one call (``lossless_process_hf_dataset``,
``build_whole_packed_dataset``)."""

from __future__ import annotations

import contextlib

from .guard import require
from .records import RECORDS


@contextlib.contextmanager
def xtuner_pack_step(pack_fn):
    """Run XTuner's ``process_hf_dataset`` with ``pack_fn`` as its pack step, for one call.

    xtuner 0.2.0 ``pack_dataset`` drops each of its ``map_num_proc`` shards' leftover. Used by
    ``data.packed_dataset.lossless_process_hf_dataset``; XTuner's function is restored on exit.
    """
    require(RECORDS["xtuner_pack_step"])  # skipped here: refuse, never pack XTuner's way
    import xtuner.dataset.huggingface as hf

    original = hf.pack_dataset
    hf.pack_dataset = pack_fn
    try:
        yield
    finally:
        hf.pack_dataset = original


@contextlib.contextmanager
def xtuner_intern_repo_packer(packer_cls):
    """Run XTuner's intern-repo ``build_packed_dataset`` with ``packer_cls`` as its packer (same
    arguments as XTuner's ``PackedDataset``: dataset, packed_length, seed).

    xtuner 0.2.0 ``PackedDataset`` cuts the concatenated documents every ``packed_length`` tokens
    and drops the last partial row. Used by ``data.intern_repo_packing.build_whole_packed_dataset``;
    XTuner's class is restored on exit.
    """
    require(RECORDS["xtuner_intern_repo_packer"])  # skipped here: refuse, never cut documents
    import xtuner.dataset.intern_repo as intern_repo

    original = intern_repo.PackedDataset
    intern_repo.PackedDataset = packer_cls
    try:
        yield
    finally:
        intern_repo.PackedDataset = original
