"""Reading an XTuner config without building it: a field, a ``type``'s name, its datasets.

MMEngine parses XTuner configs in lazy-import mode (``type=`` values are ``LazyObject`` objects):
``lazy_get``, ``type_name``, ``walk_datasets`` and ``xtuner_packs`` / ``offline_packs`` /
:func:`packing_source` read one without building anything.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from mmengine.config.lazy import LazyAttr, LazyObject

from xtuner_rope.compat.mmengine_config import ConfigDictUnavailable, config_dict

__all__ = [
    "OFFLINE_PACKED_TYPES",
    "XTUNER_DATASET_TYPES",
    "lazy_get",
    "offline_packs",
    "packing_source",
    "setter",
    "type_name",
    "walk_datasets",
    "xtuner_packs",
]


def type_name(value: object) -> str:
    """The name of a config ``type``, without building MMEngine's lazy objects."""
    if isinstance(value, (LazyObject, LazyAttr)):
        return str(value)
    if isinstance(value, str):
        return value.rsplit(".", 1)[-1]
    func = getattr(value, "func", value)  # functools.partial
    return getattr(func, "__name__", type(value).__name__)


def lazy_get(node: object, key: str, default: object = None) -> object:
    """``node[key]`` of a (Config)dict without building lazy values; ``default`` otherwise."""
    return dict.get(node, key, default) if isinstance(node, dict) else default


def walk_datasets(node: object, where: str) -> Iterator[tuple[str, dict]]:
    """Every dataset dict below a dataloader's ``dataset`` (through ``datasets=[...]`` lists)."""
    if not isinstance(node, dict):
        return
    yield where, node
    children = lazy_get(node, "datasets")
    for i, child in enumerate(children if isinstance(children, (list, tuple)) else []):
        yield from walk_datasets(child, f"{where}.datasets[{i}]")
    if isinstance(lazy_get(node, "dataset"), dict):
        yield from walk_datasets(lazy_get(node, "dataset"), f"{where}.dataset")


def setter(node: dict, key: str, value: object) -> Callable[[], None]:
    return lambda: node.__setitem__(key, value)


# XTuner's dataset builder and ours with the same arguments (xtuner_rope.data.packed_dataset).
XTUNER_DATASET_TYPES = ("process_hf_dataset", "lossless_process_hf_dataset")


def xtuner_packs(dataset: dict) -> bool:
    """``process_hf_dataset`` packing (its ``pack_to_max_length`` defaults to True)."""
    return type_name(lazy_get(dataset, "type")) in XTUNER_DATASET_TYPES and bool(
        lazy_get(dataset, "pack_to_max_length", True)
    )


# XTuner's intern-repo datasets (``xtuner.dataset.intern_repo``): every row is a pack of
# ``packed_length`` tokens with its ``cumulative_len``, whatever the config says.
# ``build_whole_packed_dataset`` (xtuner_rope.data.intern_repo_packing) is ours, same arguments.
OFFLINE_PACKED_TYPES = ("build_packed_dataset", "build_whole_packed_dataset")


def offline_packs(dataset: dict) -> bool:
    """``build_packed_dataset``: rows packed offline, each with its boundaries."""
    return type_name(lazy_get(dataset, "type")) in OFFLINE_PACKED_TYPES


def packing_source(cfg: object) -> str | None:
    """Where the train dataloader of ``cfg`` packs several dialogues per row (XTuner's offline
    packing, ``build_packed_dataset``, ``rope_collate_fn(pack=True)``), or None.
    """
    try:
        loader = lazy_get(config_dict(cfg), "train_dataloader")
    except ConfigDictUnavailable:  # not a config: nothing packed to find
        return None
    if not isinstance(loader, dict):
        return None
    for where, dataset in walk_datasets(lazy_get(loader, "dataset"), "train_dataloader.dataset"):
        if xtuner_packs(dataset):
            return f"{where} (process_hf_dataset, pack_to_max_length=True)"
        if offline_packs(dataset):
            return f"{where} (build_packed_dataset: intern-repo documents packed offline)"
    collate = lazy_get(loader, "collate_fn")
    if type_name(lazy_get(collate, "type")) == "rope_collate_fn" and lazy_get(collate, "pack"):
        return "train_dataloader.collate_fn (rope_collate_fn, pack=True)"
    return None
