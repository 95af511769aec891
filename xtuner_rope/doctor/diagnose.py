"""``xtuner-rope doctor``: a config's training data as the plugin will see it, before the GPUs.

The config is started as ``xtuner train`` starts it, the train dataset built with XTuner's own
builders, every sample and the first sampler batches checked. :func:`diagnose` gives the
JSON-ready report; output files and the summary: :mod:`xtuner_rope.doctor.report`.
"""

from __future__ import annotations

from functools import partial

from mmengine.config import Config

from xtuner_rope.config import startup
from xtuner_rope.config.as_xtuner_train import start
from xtuner_rope.config.fields import XTUNER_DATASET_TYPES, offline_packs, type_name
from xtuner_rope.config.findings import (
    MODEL_RESOURCE_EDIT,
    ConfigConflict,
    Finding,
    conflict_message,
)
from xtuner_rope.config.overrides import recheck_config
from xtuner_rope.data.truncation import counting_truncation, summed_figures
from xtuner_rope.doctor.checkpoint_space import (
    checkpoint_space,
    checkpoint_space_warnings,
    run_work_dir,
)
from xtuner_rope.doctor.heldout import heldout_report, heldout_warnings
from xtuner_rope.doctor.internvl_stats import internvl_figures, internvl_problems
from xtuner_rope.doctor.judge import exit_code, judge
from xtuner_rope.doctor.llava_stats import (
    llava_data_of,
    llava_figures,
    llava_view,
    llava_warnings,
    refuse_unserved_model,
    sampler_padding,
)
from xtuner_rope.doctor.logits_memory import logits_memory
from xtuner_rope.doctor.loss_weights import dataset_loss_weights
from xtuner_rope.doctor.packing import (
    build_dialogues_and_packs,
    intern_repo_figures,
    packing_figures,
)
from xtuner_rope.doctor.preference import (
    doctor_samples,
    preference_figures,
    preference_warnings,
)
from xtuner_rope.doctor.progress import Progress
from xtuner_rope.doctor.rope import rope_figures, rope_problems
from xtuner_rope.doctor.scan_columns import is_scannable, scan_columns
from xtuner_rope.doctor.schedule import schedule_problems
from xtuner_rope.doctor.sequence_parallel import sequence_parallel_figures as sp_figures
from xtuner_rope.doctor.sequence_parallel import sequence_parallel_warnings as sp_warnings
from xtuner_rope.doctor.stats import (
    length_percentiles,
    plan_summary,
    scan_samples,
    simulate_collate,
)
from xtuner_rope.doctor.token_columns import row_lengths
from xtuner_rope.doctor.truncation import truncated_occurrences

DEFAULT_BATCHES = 200


def plugin_resource(cfg: Config) -> str | None:
    """Name of the config's ``model_resource`` function when it is xtuner-rope's, else None."""
    resource = cfg.get("model_resource")
    fn = resource.get("fn") if isinstance(resource, dict) else None
    fn = getattr(fn, "func", fn)  # functools.partial
    module = getattr(fn, "__module__", "") or ""
    return f"{module}.{fn.__name__}" if module.split(".")[0] == "xtuner_rope" else None


def start_like_xtuner_train(
    path: str, cfg_options: dict | None = None
) -> tuple[Config, list[Finding], str | None]:
    """The config as ``xtuner train`` trains it (``config.as_xtuner_train``), and every finding
    training would meet, ``ValidatedRoPEHook``'s re-check's (``config.overrides``) included.

    Returns:
        ``(cfg, findings, resource)``: the merged config; the start-up's findings on the file's
        config plus, when it would pass, the re-check's (without the plugin: the merged config's
        findings, none applied); the file's ``model_resource`` when it is the plugin's.
    """
    cfg = Config.fromfile(path)
    resource = plugin_resource(cfg)
    findings = startup.inspect_config(cfg)  # before the start-up changes anything
    start(cfg, cfg_options, look_only=True)
    if resource is None:
        return cfg, startup.inspect_config(cfg), resource
    if any(f.fix is None for f in findings):  # the start-up refuses: training stops there
        return cfg, findings, resource
    fixes = [f for f in findings if f.fix is not None]
    return cfg, findings + recheck_config(cfg, fixes, cfg_options), resource


def build_collate_fn(loader: dict):
    """The train dataloader's collate function with its kwargs bound, as MMEngine's Runner does
    (XTuner's ``default_collate_fn`` when the config names none): ``(collate_fn, name, kwargs)``.

    Raises:
        ValueError: ``collate_fn.type`` is a string MMEngine's ``FUNCTIONS`` does not know.
    """
    from mmengine.registry import FUNCTIONS
    from xtuner.dataset.collate_fns import default_collate_fn

    kwargs = dict(loader.get("collate_fn") or {})
    fn = kwargs.pop("type", default_collate_fn)
    if isinstance(fn, str):
        name, fn = fn, FUNCTIONS.get(fn)
        if fn is None:
            raise ValueError(
                f"train_dataloader.collate_fn.type: expected a function object or a "
                f"name registered in MMEngine's FUNCTIONS, got {name!r}. Import the "
                "function in the config and pass type=<function>."
            )
    return partial(fn, **kwargs), type_name(fn), kwargs


def _dataset_facts(loader: dict) -> dict:
    """What the dataset config says: type, max_length, offline packing (XTuner's defaults)."""
    ds = loader.get("dataset") or {}
    name = type_name(ds.get("type"))
    xtuner = name in XTUNER_DATASET_TYPES
    max_length = ds.get("max_length") if xtuner else None
    if offline_packs(ds):  # intern-repo rows: packed_length tokens each (8192: XTuner's default)
        max_length = ds.get("packed_length", 8192)
    return {
        "type": name,
        "max_length": max_length,
        # process_hf_dataset packs unless told not to
        "pack_to_max_length": bool(ds.get("pack_to_max_length", True)) if xtuner else False,
        "packed_offline": offline_packs(ds),
    }


def _source_rows(loader: dict, facts: dict) -> int | None:
    """Rows of the raw data behind a ``process_hf_dataset`` (to count its drops)."""
    from xtuner.registry import BUILDER

    ds = loader.get("dataset") or {}
    if (
        facts["type"] not in XTUNER_DATASET_TYPES
        or not isinstance(ds.get("dataset"), dict)
        or ds.get("max_dataset_length")
    ):
        return None
    raw = BUILDER.build(ds["dataset"])
    split = ds.get("split", "train")
    if hasattr(raw, "keys") and split in raw.keys():
        raw = raw[split]
    return len(raw)


def _build_dataset(cfg: Config, facts: dict, progress: Progress):
    """``(dataset, lengths, packing, truncation)``: the train dataset; when packing, the ``[n]``
    dialogue lengths before it and :func:`packing_figures` (else None, None); what XTuner's
    ``encode_fn`` cut (None without an XTuner tokenize step)."""
    from xtuner.registry import BUILDER

    if facts["packed_offline"]:  # intern-repo rows: the packers keep their documents
        progress.stage("building the train dataset as xtuner train builds it")
        with counting_truncation() as truncation:  # the untokenized loader's encode_fn cut
            dataset = BUILDER.build(cfg.train_dataloader.dataset)
        figures = intern_repo_figures(dataset, facts["max_length"])
        return (dataset, *figures, summed_figures(truncation))
    if not facts["pack_to_max_length"]:
        progress.stage("building the train dataset as xtuner train builds it")
        with counting_truncation() as truncation:
            dataset = BUILDER.build(cfg.train_dataloader.dataset)
        return dataset, None, None, summed_figures(truncation)
    seed = (cfg.get("randomness") or {}).get("seed")
    dataset_cfg = cfg.train_dataloader.dataset
    dialogues, packed, truncation, used = build_dialogues_and_packs(dataset_cfg, seed, progress)
    packing = packing_figures(dialogues, packed, facts["max_length"], progress=progress)
    shuffled = dataset_cfg.get("shuffle_before_pack", True)  # XTuner's default
    packing["shuffle_seed"] = {"used": used, "drawn": seed is None} if shuffled else None
    return packed, row_lengths(dialogues).tolist(), packing, truncation


def _findings(findings: list[Finding]) -> dict:
    def as_dict(f: Finding) -> dict:
        return {"setting": f.setting, "problem": f.problem, "edit": f.edit}

    return {
        "fixes": [as_dict(f) for f in findings if f.fix is not None],
        "conflicts": [as_dict(f) for f in findings if f.fix is None],
    }


def refuse_unreadable_checkpoint(findings: list) -> None:
    """Stop before the data when the start-up refuses the LLM's unreadable ``config.json``
    (the data's tokenizer comes from that checkpoint: ``xtuner train`` stops there too).

    Raises:
        ConfigConflict: every conflict of the start-up's ``findings`` (its message), when one of them is
            ``config.checkpoint_findings``' refusal.
    """
    from xtuner_rope.config.checkpoint_findings import is_unreadable_checkpoint

    conflicts = [f for f in findings if f.fix is None]
    if any(is_unreadable_checkpoint(f) for f in conflicts):
        raise ConfigConflict(conflict_message(conflicts))


def diagnose(
    config: str,
    cfg_options: dict | None = None,
    batches: int = DEFAULT_BATCHES,
    progress: bool = True,
    work_dir: str | None = None,
) -> tuple[dict, list[int]]:
    """Check a config's train data and settings; see the module docstring.

    Args:
        progress: Its steps and bars on stderr while it works (:mod:`xtuner_rope.doctor.progress`).
        work_dir: The run's ``--work-dir`` (default: the config's, else XTuner's default), where
            the checkpoints' size and free space are judged.

    Returns:
        ``(report, lengths)``: the JSON-ready report (``problems`` and ``warnings`` included)
        and the ``[n]`` dialogue lengths before any offline packing (for the histogram).
    """
    steps = Progress(progress)
    refuse_unserved_model(config)  # a model the start-up refuses: before its data are read
    steps.stage("starting the config as xtuner train does")
    cfg, findings, resource = start_like_xtuner_train(config, cfg_options)
    refuse_unreadable_checkpoint(findings)  # no data without the checkpoint's tokenizer
    loader = cfg.train_dataloader
    facts = _dataset_facts(loader)
    collate_fn, collate_name, collate_kwargs = build_collate_fn(loader)
    dataset, dialogue_lengths, packing, truncation = _build_dataset(cfg, facts, steps)
    batch_size = int(loader.get("batch_size", 1))
    internvl = internvl_figures(cfg, dataset, batch_size)  # each item built once, uncut
    truncation = truncation or (internvl or {}).pop("truncation", None)
    llava = llava_view(cfg, dataset, collate_fn)  # LLaVA: lengths after the image expansion
    items = doctor_samples(dataset) if llava is None else llava.scan_items
    steps.stage(f"checking {len(items)} samples")
    scan = (scan_columns if is_scannable(items) else scan_samples)(
        items,
        collate_max_length=collate_kwargs.get("max_length"),
        truncation_length=None
        if facts["pack_to_max_length"] or facts["packed_offline"] or truncation
        else facts["max_length"],
        progress=steps,
    )
    if truncation:  # counted exactly in the tokenize step (packed or not)
        scan.issues["truncated"] = truncated_occurrences(truncation)
    steps.stage(f"collating the first {min(batches, -(-len(dataset) // batch_size))} batches")
    plan = simulate_collate(
        dataset if llava is None else llava.collate_items,
        collate_fn if llava is None else llava.collate_fn,
        batch_size,
        batches,
        scan,
        progress=steps.enabled,
    )
    source = _source_rows(loader, facts)
    lengths = scan.lengths if dialogue_lengths is None else dialogue_lengths
    kept = len(lengths)
    report = {
        "config": str(config),
        "plugin": {
            "enabled": resource is not None,
            "model_resource": resource,
            "edit": None if resource else MODEL_RESOURCE_EDIT,
        },
        "findings": _findings(findings),
        "dataset": {
            **facts,
            "samples": len(dataset),
            "documents": scan.documents,
            "tokens": int(sum(scan.lengths)),
            "source_rows": source,
            "dialogues": kept,
            "dropped_by_dataset": None if source is None else source - kept,
        },
        "truncation": truncation,
        "lengths": length_percentiles(lengths),  # of the dialogues, before any packing
        "packing": None
        if packing is None
        else {**packing, "row_lengths": length_percentiles(scan.lengths)},
        "samples": {kind: vars(occ) for kind, occ in scan.issues.items()},
        "collate": {
            "name": collate_name,
            "kwargs": {
                k: v if isinstance(v, (bool, int, float, str, type(None))) else str(v)
                for k, v in collate_kwargs.items()
            },
            "batch_size": batch_size,
            "max_length": collate_kwargs.get("max_length"),
            "order": "dataset order (no shuffle)",
            "batches_total": -(-len(dataset) // batch_size),
            **plan_summary(plan),
        },
        "loss_weights": dataset_loss_weights(
            items,
            scan.supervised,
            batch_size,
            (cfg.get("optim_wrapper") or {}).get("accumulative_counts", 1),
            batches,
        ),
    }
    report["multimodal"] = (
        None
        if llava is None
        else llava_figures(
            llava, dataset, collate_kwargs, (loader.get("dataset") or {}).get("max_length")
        )
    )
    if llava is not None and loader.get("sampler"):  # LengthGroupedSampler: its own order
        report["multimodal"]["sampler_order"] = sampler_padding(
            cfg, dataset, scan.lengths, batch_size, batches
        )
    report["packed"] = bool(
        facts["pack_to_max_length"]
        or facts["packed_offline"]
        or collate_kwargs.get("pack")
        or scan.documents > len(dataset)
        or bool(llava and llava.packed_rows)
        or (collate_name == "internvl_collate_fn" and collate_kwargs.get("pack", True))
    )  # llava_collate_fn / internvl_collate_fn rows
    report["preference"] = preference_figures(cfg, dataset)  # pairs, not dialogues
    report["sequence_parallel"] = sp_figures(
        cfg.get("sequence_parallel_size", 1), scan.lengths, plan.shapes
    )
    if report["preference"]:  # TokenWeightedLossHook serves SupervisedFinetune only
        report["loss_weights"] = None
    report["rope"] = rope_figures(cfg, lengths, report["packed"])
    report["logits"] = logits_memory(
        cfg, facts["max_length"] or report["collate"]["max_length"], bool(resource)
    )
    report["problems"], report["warnings"] = judge(report)
    report["problems"] += rope_problems(report["rope"])
    report["warnings"] += preference_warnings(report)
    report["warnings"] += sp_warnings(report["sequence_parallel"])
    report["problems"] += [] if llava is None else llava_data_of(llava, dataset)
    report["internvl"] = internvl
    report["problems"] += internvl_problems(report["internvl"])
    report["warnings"] += llava_warnings(report["multimodal"])
    report["heldout"] = heldout_report(
        cfg, dataset, bool(report["findings"]["conflicts"]), build_collate_fn
    )
    report["warnings"] += heldout_warnings(report["heldout"])
    report["problems"] += schedule_problems(
        cfg.get("param_scheduler"), len(dataset), batch_size, bool(loader.get("drop_last", False))
    )
    report["checkpoints"] = checkpoint_space(
        cfg, len(dataset), batch_size, run_work_dir(cfg, config, work_dir)
    )
    report["warnings"] += checkpoint_space_warnings(report["checkpoints"])
    report["exit_code"] = exit_code(report)
    return report, lengths
