"""Start-up findings on XTuner's ``MOSSSFTDataset``: a data file its cache would overwrite.

``MOSSSFTDataset`` (xtuner 0.2.0, ``xtuner/dataset/moss_sft.py``) tokenizes its JSON lines once
and caches them beside the file, under the file's name with ``.jsonl`` replaced by
``_data_<tokenizer>_<bot>`` (and ``_no_loss_spans_...``). A name without ``.jsonl`` is left as
it is, so the cache *is* the data file: the dataset ``torch.load``\\ s the JSON lines itself
(``UnpicklingError: Weights only load failed``) or, had the cache been written first, would
overwrite the user's data with a pickle. Such a setting is refused before the weights load.
"""

from __future__ import annotations

from mmengine.config import Config

from xtuner_rope.compat.mmengine_config import config_dict

from .fields import lazy_get, type_name, walk_datasets
from .findings import Finding
from .startup import register_findings


@register_findings("packing")
def moss_data_file_findings(cfg: Config) -> list[Finding]:
    """A conflict per ``MOSSSFTDataset`` whose ``data_file`` does not contain ``.jsonl``."""
    found = []
    loader = lazy_get(config_dict(cfg), "train_dataloader")
    for where, dataset in walk_datasets(lazy_get(loader, "dataset"), "train_dataloader.dataset"):
        if type_name(lazy_get(dataset, "type")).rsplit(".", 1)[-1] != "MOSSSFTDataset":
            continue
        path = lazy_get(dataset, "data_file")
        if not isinstance(path, str) or ".jsonl" in path:
            continue
        found.append(
            Finding(
                f"{where}.data_file",
                f"{path!r}: MOSSSFTDataset names its token cache by replacing '.jsonl' in the "
                "data file's name; without it the cache is the data file itself (XTuner would "
                "torch.load the JSON lines: UnpicklingError, or overwrite them with its cache)",
                "give the MOSS data file a name ending in .jsonl (rename or link it, e.g. "
                "moss-003-sft-no-tools.jsonl) and point data_file at that name",
            )
        )
    return found
