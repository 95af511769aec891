"""Start-up findings on XTuner's ``MOSSSFTDataset``: a data file its cache would overwrite.

xtuner 0.2.0 caches the tokenized lines beside the file, its name with ``.jsonl`` replaced: a
name without ``.jsonl`` makes the cache the data file itself. Refused before the weights load.
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
