"""Start-up: load xtuner-rope before XTuner builds anything, then check and prepare the config.

``xtuner train`` runs ``cfg.model_resource.fn`` first thing (``xtuner.tools.utils.
set_model_resource``), before its own config check, the distributed start, the model and the
dataset. :func:`enable_xtuner_rope` is meant for that slot: importing it loads the plugin (and
its ``compat`` patches) early enough, and it reads the config that is being started, so every
setting that conflicts with the plugin is refused before a single weight is loaded, with the
setting and the exact edit named. What has one right answer is done here instead of asked for,
and each change is logged:

- the plugin's hooks are added to ``custom_hooks`` (no hook entry to forget): the validated
  RoPE and packed attention, the per-batch checks, the packing figures in the log and the
  non-finite-loss tripwire;
- XTuner's offline packing (``process_hf_dataset(pack_to_max_length=True)``) records the
  document boundaries (the dataset's ``use_varlen_attn=True``; the packs are the same) and
  drops nothing (``type=lossless_process_hf_dataset``, same arguments: XTuner's
  ``pack_dataset`` drops each of its ``map_num_proc`` shards' leftover);
- XTuner's ``default_collate_fn`` keeps those boundaries (its ``use_varlen_attn=True``, batch
  size 1 only, as in XTuner);
- the stock ``use_varlen_attn = True`` switch no longer needs flash-attn: the plugin isolates
  documents itself, so XTuner's flash-attn check is switched off and its
  ``VarlenAttnArgsToMessageHubHook`` leaves room for ours (same MessageHub keys).

:func:`inspect_config` is pure (the ``xtuner-rope doctor`` and the hooks call it too);
:func:`prepare_config` applies the fixes and raises :class:`ConfigConflict` for the rest.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from mmengine.config import Config
from mmengine.config.lazy import LazyAttr, LazyObject
from mmengine.logging import print_log

from xtuner_rope.compat import cpu_only, keep_other_model_paths

# The plugin's hooks, in the order they are added to custom_hooks, and where they live.
PLUGIN_HOOKS = {
    "ValidatedRoPEHook": "xtuner_rope.hooks",
    "PackedBatchCheckHook": "xtuner_rope.hooks",
    "PackingMetricsHook": "xtuner_rope.hooks.monitor",
    "NonFiniteTripwireHook": "xtuner_rope.hooks.monitor",
    "TokenWeightedLossHook": "xtuner_rope.hooks.loss_norm",
}
MODEL_RESOURCE_EDIT = (
    "add to PART 1 of the config:\n"
    "    from xtuner_rope import enable_xtuner_rope\n"
    "    model_resource = dict(fn=enable_xtuner_rope)"
)

# "fixes": what the start-up applied, so the re-check of the config that really trains can
# name a fix that an override (``--cfg-options``, merged after the start-up) undid.
_STATE = {"prepared": False, "fixes": []}
FindingsFn = Callable[[Config], list]  # a config -> its findings (`Finding` list)


class ConfigConflict(ValueError):
    """Settings of an XTuner config that would make training fail or silently wrong."""


@dataclass
class Finding:
    """One setting the plugin must change (``fix`` set) or refuse (``fix`` None).

    Attributes:
        setting: Where it is, in config terms (``train_dataloader.collate_fn``).
        problem: What goes wrong with it.
        edit: The exact edit a user makes (for a conflict), or what the fix did (for a fix).
        fix: Applies the change to the config in place; None for a conflict.
    """

    setting: str
    problem: str
    edit: str
    fix: Callable[[], None] | None = field(default=None, repr=False)

    def __str__(self) -> str:
        return f"{self.setting}: {self.problem}\n  -> {self.edit}"


def type_name(value: object) -> str:
    """The name of a config ``type``, without building MMEngine's lazy objects."""
    if isinstance(value, (LazyObject, LazyAttr)):
        return str(value)
    if isinstance(value, str):
        return value.rsplit(".", 1)[-1]
    func = getattr(value, "func", value)  # functools.partial
    return getattr(func, "__name__", type(value).__name__)


def _get(node: object, key: str, default: object = None) -> object:
    """``node[key]`` of a (Config)dict without building lazy values; ``default`` otherwise."""
    return dict.get(node, key, default) if isinstance(node, dict) else default


def _datasets(node: object, where: str) -> Iterator[tuple[str, dict]]:
    """Every dataset dict below a dataloader's ``dataset`` (through ``datasets=[...]`` lists)."""
    if not isinstance(node, dict):
        return
    yield where, node
    children = _get(node, "datasets")
    for i, child in enumerate(children if isinstance(children, (list, tuple)) else []):
        yield from _datasets(child, f"{where}.datasets[{i}]")
    if isinstance(_get(node, "dataset"), dict):
        yield from _datasets(_get(node, "dataset"), f"{where}.dataset")


# XTuner's dataset builder and ours with the same arguments (xtuner_rope.data.packed_dataset).
XTUNER_DATASET_TYPES = ("process_hf_dataset", "lossless_process_hf_dataset")


def _xtuner_packs(dataset: dict) -> bool:
    """``process_hf_dataset`` packing (its ``pack_to_max_length`` defaults to True)."""
    return type_name(_get(dataset, "type")) in XTUNER_DATASET_TYPES and bool(
        _get(dataset, "pack_to_max_length", True)
    )


def _packs_without_boundaries(dataset: dict) -> bool:
    return _xtuner_packs(dataset) and not _get(dataset, "use_varlen_attn")


def flash_attn_findings(cfg: Config) -> list[Finding]:
    """``attn_implementation="flash_attention_2"`` where flash-attn cannot run: use SDPA.

    Two places ask for it: ``model.llm.attn_implementation`` (XTuner's stock Mistral configs;
    transformers then refuses to build the model) and, when the LLM dict sets none, a local
    checkpoint's ``config.json`` (InternLM2 remote code picks its attention class from
    ``config.attn_implementation`` and imports flash-attn at the first forward). The packed
    attention of xtuner-rope isolates documents on every backend, so SDPA loses nothing.
    """
    from transformers.utils import is_flash_attn_2_available

    llm = _get(_get(cfg._cfg_dict, "model"), "llm")
    if not isinstance(llm, dict) or is_flash_attn_2_available():
        return []
    source, asked = "", _get(llm, "attn_implementation")
    if asked is None:
        source, asked = _checkpoint_attn_implementation(cfg)
    if asked != "flash_attention_2":
        return []
    return [
        Finding(
            "model.llm.attn_implementation",
            f'"flash_attention_2"{source} needs flash-attn, which '
            "is not usable here (not installed, or no CUDA): the model would fail to build or to "
            "run",
            'set to "sdpa": xtuner-rope\'s packed attention isolates documents on every backend',
            _setitem(llm, "attn_implementation", "sdpa"),
        )
    ]


def model_family_findings(cfg: Config) -> list[Finding]:
    """The LLM's family, read from its ``config.json`` before a weight loads: refuse what
    xtuner-rope cannot serve (``models.families.REFUSED``: GPT-BigCode, remote-code families).

    A checkpoint whose ``config.json`` cannot be read (a hub id offline) is refused by
    ``config.checkpoint_findings``; one without ``model_type`` by ``ValidatedRoPEHook`` after
    it loaded.
    """
    from xtuner_rope.models.families import UNSERVED_ADVICE, checkpoint_verdict, model_class_verdict

    from .checkpoint_findings import llm_checkpoint_path

    llm = _get(_get(cfg._cfg_dict, "model"), "llm")
    setting, verdict = (
        "model.llm.type",
        model_class_verdict(getattr(_get(llm, "type"), "_module", None)),
    )  # XTuner's own DeepSeek-V2 package
    if verdict is None:
        setting = "model.llm.pretrained_model_name_or_path"
        verdict = checkpoint_verdict(llm_checkpoint_path(cfg))
    if verdict is None or verdict[1] is None:
        return []
    where, refusal = verdict
    return [Finding(setting, f"{where}: {refusal}", UNSERVED_ADVICE)]


def _checkpoint_attn_implementation(cfg: Config) -> tuple[str, object]:
    """``attn_implementation`` of the LLM's ``config.json`` (None when unreadable)."""
    from .checkpoint_findings import llm_checkpoint_config

    config = llm_checkpoint_config(cfg)
    if config is None or config.data is None:
        return "", None
    return f" (from {config.source})", config.get("attn_implementation")


def _setitem(node: dict, key: str, value: object) -> Callable[[], None]:
    return lambda: node.__setitem__(key, value)


def _packing_findings(loader: dict) -> list[Finding]:
    """XTuner's offline packing: boundaries must be recorded and survive the collate function."""
    findings, packed = [], False
    for where, dataset in _datasets(_get(loader, "dataset"), "train_dataloader.dataset"):
        packed = packed or _xtuner_packs(dataset)
        if _packs_without_boundaries(dataset):
            findings.append(
                Finding(
                    f"{where}.use_varlen_attn",
                    "process_hf_dataset(pack_to_max_length=True) joins "
                    "dialogues without recording where each starts: documents would attend to each "
                    "other",
                    "set to True: XTuner's Packer records the boundaries (same packs)",
                    _setitem(dataset, "use_varlen_attn", True),
                )
            )
    collate = _get(loader, "collate_fn")
    name = type_name(_get(collate, "type")) if isinstance(collate, dict) else "default_collate_fn"
    batch_size = _get(loader, "batch_size", 1)
    if not packed or name == "rope_collate_fn":
        return findings
    if name == "default_collate_fn" and batch_size == 1:
        if not _get(collate, "use_varlen_attn"):
            findings.append(
                Finding(
                    "train_dataloader.collate_fn.use_varlen_attn",
                    "default_collate_fn drops the packed rows' boundaries",
                    "set to True: it keeps cumulative_len/position_ids (batch size 1)",
                    _setitem(collate, "use_varlen_attn", True),
                )
            )
        return findings
    why = (
        f"XTuner's default_collate_fn keeps document boundaries only at batch_size=1, got "
        f"{batch_size}"
        if name == "default_collate_fn"
        else f"collate function {name} is not known to keep document boundaries"
    )
    findings.append(
        Finding(
            "train_dataloader.collate_fn",
            f"packed rows: {why}",
            "use collate_fn=dict(type=rope_collate_fn, max_length=max_length) "
            "(from xtuner_rope import rope_collate_fn; any batch size)",
        )
    )
    return findings


def _lossless_packing_findings(loader: dict) -> list[Finding]:
    """XTuner's offline packing drops each ``map_num_proc`` shard's leftover: use ours."""
    findings = []
    for where, dataset in _datasets(_get(loader, "dataset"), "train_dataloader.dataset"):
        if _xtuner_packs(dataset) and type_name(_get(dataset, "type")) == "process_hf_dataset":
            procs = _get(dataset, "map_num_proc", 32)
            findings.append(
                Finding(
                    f"{where}.type",
                    f"process_hf_dataset packs in map_num_proc={procs} worker(s) "
                    "and drops each worker's last leftover below max_length (tokens and "
                    "supervised labels lost)",
                    "set to lossless_process_hf_dataset "
                    "(xtuner_rope.data.packed_dataset, same arguments): XTuner's packs of the whole "
                    "stream, the leftover kept as a short last row",
                    _setitem(
                        dataset,
                        "type",
                        LazyObject(
                            "xtuner_rope.data.packed_dataset", "lossless_process_hf_dataset"
                        ),
                    ),
                )
            )
    return findings


def _varlen_findings(cfg: Config) -> list[Finding]:
    """The stock ``use_varlen_attn = True`` switch: served by the plugin, flash-attn or not."""
    if not _get(cfg._cfg_dict, "use_varlen_attn"):
        return []
    findings = [
        Finding(
            "use_varlen_attn",
            "XTuner's start-up check demands flash-attn and batch size 1 for it",
            "set to False at the top level only (the model, dataset and collate function keep "
            "theirs): xtuner-rope isolates documents itself, on every attention backend",
            _setitem(cfg._cfg_dict, "use_varlen_attn", False),
        )
    ]
    hooks = _get(cfg._cfg_dict, "custom_hooks") or []
    varlen = [h for h in hooks if type_name(_get(h, "type")) == "VarlenAttnArgsToMessageHubHook"]
    if varlen:

        def drop() -> None:
            hooks[:] = [h for h in hooks if not any(h is v for v in varlen)]

        findings.append(
            Finding(
                "custom_hooks",
                "VarlenAttnArgsToMessageHubHook publishes the boundaries that "
                "PackedBatchCheckHook publishes (checked) under the same MessageHub keys",
                "removed VarlenAttnArgsToMessageHubHook",
                drop,
            )
        )
    return findings


def _hook_findings(cfg: Config) -> list[Finding]:
    hooks = _get(cfg._cfg_dict, "custom_hooks")
    present = {type_name(_get(h, "type")) for h in hooks or []}
    missing = [name for name in PLUGIN_HOOKS if name not in present]
    if not missing:
        return []

    def add() -> None:
        added = [dict(type=LazyObject(PLUGIN_HOOKS[name], name)) for name in missing]
        if hooks is None:
            cfg._cfg_dict["custom_hooks"] = added
        else:
            hooks[:0] = added

    return [
        Finding(
            "custom_hooks",
            f"{', '.join(missing)} missing",
            f"added {', '.join(f'dict(type={n})' for n in missing)}",
            add,
        )
    ]


def _runtime_findings(cfg: Config) -> list[Finding]:
    """Settings the plugin cannot serve on this machine or at all."""
    findings = []
    optim = _get(cfg._cfg_dict, "optim_wrapper")
    if type_name(_get(optim, "type")) == "AmpOptimWrapper" and cpu_only():
        findings.append(
            Finding(
                "optim_wrapper.type",
                "AmpOptimWrapper needs a GPU (MMEngine refuses it on this CPU-only machine)",
                "use type=OptimWrapper (from mmengine.optim import OptimWrapper) "
                "and delete its loss_scale and dtype entries: full fp32 on CPU",
            )
        )
    return findings + _sequence_parallel_findings(cfg)


def _sequence_parallel_findings(cfg: Config) -> list[Finding]:
    """``sequence_parallel_size``: served for SFT (``models.sequence_parallel``), else refused.

    Heads not divisible by the size need no refusal on GPUs: XTuner's inner sequence parallel
    splits the head dimension, and the plugin's all-to-all goes through it (on a CPU-only
    machine ``startup_sequence_parallel`` refuses them from the checkpoint's config.json).
    """
    sp = _get(cfg._cfg_dict, "sequence_parallel_size", 1)
    if not isinstance(sp, int) or isinstance(sp, bool) or sp < 1:
        return [
            Finding(
                "sequence_parallel_size",
                f"{sp!r} is not a positive int",
                "set sequence_parallel_size = 1 (off) or the number of ranks per row",
            )
        ]
    model = type_name(_get(_get(cfg._cfg_dict, "model"), "type"))
    if sp > 1 and model != "SupervisedFinetune":
        return [
            Finding(
                "sequence_parallel_size",
                f"{sp} with model type {model}: xtuner-rope serves "
                "sequence parallel for SupervisedFinetune (SFT) only; XTuner's DPO/ORPO/reward "
                "sequence-parallel paths are not wired to its packed attention",
                "set sequence_parallel_size = 1 for this model",
            )
        ]
    collate = _get(_get(cfg._cfg_dict, "train_dataloader"), "collate_fn")
    if (
        sp == 1
        or not isinstance(collate, dict)
        or (type_name(_get(collate, "type")) != "default_collate_fn")
    ):
        return []

    def use_ours() -> None:
        collate["type"] = LazyObject("xtuner_rope.data.collate", "rope_collate_fn")
        collate["pad_to_multiple_of"] = sp

    return [
        Finding(
            "train_dataloader.collate_fn",
            f"default_collate_fn asserts that packed rows divide by "
            f"sequence_parallel_size={sp} (XTuner pads only rows without boundaries)",
            f"set to rope_collate_fn (same arguments) with pad_to_multiple_of={sp}: rows padded by "
            "a segment of their own",
            use_ours,
        )
    ]


def inspect_config(cfg: Config) -> list[Finding]:
    """Every change the plugin needs in ``cfg`` and every conflict it cannot resolve.

    Pure: nothing is changed until a finding's ``fix`` is called (see :func:`prepare_config`).

    Args:
        cfg: An XTuner config, as ``Config.fromfile`` returns it (lazy objects unbuilt).

    Returns:
        The findings, fixes and conflicts, in config order.
    """
    return [
        finding
        for _, check in sorted(FINDINGS, key=lambda entry: entry[0])
        for finding in check(cfg)
    ]


def register_findings(order: int) -> Callable[[FindingsFn], FindingsFn]:
    """Decorator: add a findings function to what :func:`inspect_config` runs, at ``order``.

    Findings modules (``config.multimodal``, ``config.launch``, ``hooks.loss_norm`` ...) register
    themselves when imported (``xtuner_rope.activate`` imports them all); the order fixes where
    their findings appear in the start-up's report (lower first; the slots are in ``FINDINGS``).
    """

    def register(check: FindingsFn) -> FindingsFn:
        if all(registered is not check for _, registered in FINDINGS):
            FINDINGS.append((order, check))
        return check

    return register


def _loader_findings(cfg: Config) -> list[Finding]:
    loader = _get(cfg._cfg_dict, "train_dataloader")
    if not isinstance(loader, dict):
        return []
    return _packing_findings(loader) + _lossless_packing_findings(loader)


# (order, findings function): this module's own; the others register with `register_findings`
# at 30 (loss normalization), 40 (multimodal), 50 (launch), 60 (sequence-parallel heads),
# 65 (RoPE scaling) and 110 (preference).
FINDINGS: list[tuple[int, FindingsFn]] = [
    (10, _varlen_findings),
    (20, _loader_findings),
    (70, _hook_findings),
    (80, _runtime_findings),
    (90, flash_attn_findings),
    (100, model_family_findings),
]


def conflict_message(conflicts: list[Finding]) -> str:
    """One error text listing every conflict with the edit that resolves it."""
    items = "\n".join(f"{i}. {c}" for i, c in enumerate(conflicts, 1))
    return (
        f"xtuner-rope: {len(conflicts)} setting(s) of this config would make training fail "
        f"or silently wrong; edit the config and start again:\n{items}"
    )


def prepare_config(cfg: Config) -> list[Finding]:
    """Apply the plugin's fixes to ``cfg`` and refuse what cannot be fixed.

    Args:
        cfg: The config about to be trained; changed in place.

    Returns:
        The fixes applied (each also logged).

    Raises:
        ConfigConflict: a setting conflicts with the plugin; the message lists each one with
            the exact edit, all at once.
    """
    findings = inspect_config(cfg)
    conflicts = [f for f in findings if f.fix is None]
    if conflicts:
        raise ConfigConflict(conflict_message(conflicts))
    fixes = [f for f in findings if f.fix is not None]
    for fix in fixes:
        fix.fix()
        print_log(f"xtuner-rope: {fix.setting}: {fix.problem}; {fix.edit}.", logger="current")
    _STATE["prepared"] = True
    _STATE["fixes"] = fixes
    return fixes


def applied_fixes() -> list[Finding]:
    """The fixes the start-up applied in this process (empty before it ran)."""
    return list(_STATE["fixes"])


def is_prepared() -> bool:
    """True once :func:`prepare_config` ran in this process (through ``model_resource``)."""
    return _STATE["prepared"]


@contextmanager
def state_kept() -> Iterator[None]:
    """Run the block and put the start-up's state (prepared, fixes) back as it was.

    For tools that start a config as ``xtuner train`` does only to look at it (the doctor):
    the process must not count as prepared afterwards.
    """
    kept = dict(_STATE)
    try:
        yield
    finally:
        _STATE.update(kept)


def _config_being_started() -> Config | None:
    """The config of the ``xtuner train`` that called our ``model_resource`` function.

    xtuner 0.2.0 calls ``set_model_resource(cfg)`` -> ``fn(path, **args)``: the config is a
    local of a caller frame; it is not passed to ``fn``.
    """
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "set_model_resource":
            cfg = frame.f_locals.get("cfg")
            return cfg if isinstance(cfg, Config) else None
        frame = frame.f_back
    return None


def prepare_started_config(path: str) -> str:
    """Prepare the config of the calling ``xtuner train`` (if any); return ``path``."""
    cfg = _config_being_started()
    if cfg is not None:
        prepare_config(cfg)
        keep_other_model_paths(cfg, path)  # a LLaVA config's CLIP paths are not the LLM's
    return path


def enable_xtuner_rope(path: str, local_only: bool = False) -> str:
    """``model_resource`` function: load xtuner-rope, check and prepare the config.

    Use as ``model_resource = dict(fn=enable_xtuner_rope)`` in PART 1 of an XTuner config.
    ``xtuner train`` calls it before anything is built; the path (a hub id or a local
    directory) is returned unchanged.

    Args:
        path: The config's ``pretrained_model_name_or_path``.
        local_only: Refuse a path that is not a local checkpoint directory (the recipes in
            ``configs/`` expect a downloaded checkpoint: no download at training time).

    Returns:
        ``path``.

    Raises:
        ConfigConflict: see :func:`prepare_config`.
        FileNotFoundError: ``local_only`` and ``path`` has no ``config.json``; the message
            says how to fix it.
    """
    if local_only and not (Path(path) / "config.json").is_file():
        raise FileNotFoundError(
            f"model_resource: pretrained_model_name_or_path={path!r} is not a local checkpoint "
            "directory (no config.json there). Download it first, e.g. `huggingface-cli download "
            "internlm/internlm2-chat-7b --local-dir <dir>`, and set "
            "pretrained_model_name_or_path in PART 1 of the config to <dir>."
        )
    return prepare_started_config(path)


def packing_source(cfg: object) -> str | None:
    """Where the train dataloader of ``cfg`` packs several dialogues per row, or None.

    XTuner's offline packing (``process_hf_dataset``, ``pack_to_max_length`` defaults to True)
    or ``rope_collate_fn(pack=True)``: such rows must reach the model with boundaries.
    """
    loader = _get(getattr(cfg, "_cfg_dict", None), "train_dataloader")
    if not isinstance(loader, dict):
        return None
    for where, dataset in _datasets(_get(loader, "dataset"), "train_dataloader.dataset"):
        if _xtuner_packs(dataset):
            return f"{where} (process_hf_dataset, pack_to_max_length=True)"
    collate = _get(loader, "collate_fn")
    if type_name(_get(collate, "type")) == "rope_collate_fn" and _get(collate, "pack"):
        return "train_dataloader.collate_fn (rope_collate_fn, pack=True)"
    return None


def require_prepared(cfg: object, who: str) -> None:
    """Refuse a run whose config was not prepared at start-up (the plugin loaded too late).

    Args:
        cfg: ``runner.cfg``; only configs read from a file are judged (a runner built in code
            without a config file has nothing to prepare).
        who: The caller, for the message.

    Raises:
        ConfigConflict: ``cfg`` is a Config and :func:`prepare_config` never ran here.
    """
    if not isinstance(cfg, Config) or cfg.filename is None or is_prepared():
        return
    raise ConfigConflict(
        f"{who}: xtuner-rope was loaded after XTuner built the model, too late for its "
        "start-up: its patches (LoRA/QLoRA's bitsandbytes import, CPU training) and its "
        "config checks (packing without boundaries, use_varlen_attn, AMP on CPU) did not run. "
        f"To fix, {MODEL_RESOURCE_EDIT}\n(or call xtuner_rope.config.startup.prepare_config(cfg) "
        "before building the Runner yourself)."
    )


__all__ = [
    "ConfigConflict",
    "Finding",
    "enable_xtuner_rope",
    "inspect_config",
    "is_prepared",
    "packing_source",
    "prepare_config",
    "require_prepared",
]
