"""``xtuner-rope check``: prove isolation on the user's own model, dtype, kernel and data.

The config is started as ``xtuner train`` starts it (``set_model_resource``, which runs the
plugin's start-up, then the ``--cfg-options`` overrides, in that order), MMEngine's ``Runner``
builds its model (real weights from the config's path, on this machine's device) and its hooks,
and the first batches come from the config's own dataset and collate function. Then, for each
batch, :mod:`xtuner_rope.doctor.check_measure` compares the packed rows with each document alone:

1. unpatched (the model as built): each document alone, its logits, loss and gradients;
   greedy generation of the first document's prompt;
2. the plugin's hooks run as in training (``ValidatedRoPEHook.before_train`` patches the model,
   the boundary hooks' ``before_train_iter`` publish the batch's boundaries);
3. patched: the packed batch through ``SupervisedFinetune`` as the training step calls it; its
   logits, loss and gradients against step 1; the same generation.

A config without the plugin is measured the same way (nothing is patched): the differences
are the leak of XTuner's own packing. The unpatched reference is the same module before the
patch, so a 7B model is held once; see :func:`run_check` for the memory bounds.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import torch
from mmengine.config import Config

from xtuner_rope.config import startup
from xtuner_rope.config.as_xtuner_train import start_file
from xtuner_rope.config.multimodal import is_llava
from xtuner_rope.doctor import check_measure as cm
from xtuner_rope.doctor.check_measure import BOUNDARY_HOOKS
from xtuner_rope.doctor.check_randomness import randomness_off
from xtuner_rope.doctor.check_report import judge
from xtuner_rope.doctor.diagnose import build_collate_fn, plugin_resource
from xtuner_rope.doctor.llava_stats import refuse_unserved_model
from xtuner_rope.models.runtime import chosen_backends

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def start_config(path: str, cfg_options: dict | None = None) -> Config:
    """The config as ``xtuner train`` has it when it builds the Runner.

    ``Config.fromfile``, then the config's ``model_resource`` (the plugin's start-up when the
    config enables it), then the ``--cfg-options`` overrides (xtuner/tools/train.py's order).

    Raises:
        ConfigConflict: the plugin's start-up refuses a setting (message names the edit).
    """
    return start_file(path, cfg_options)


def build_runner(cfg: Config, work_dir: Path):
    """MMEngine's ``Runner`` of the config (model on this machine's device, hooks built).

    A DeepSpeed config (``runner_type="FlexibleRunner"``) is built with the plain Runner: the
    check holds one unsharded copy of the model on one device.
    """
    from mmengine.runner import Runner

    cfg = copy.deepcopy(cfg)
    cfg.work_dir = str(work_dir)
    cfg.launcher = "none"
    cfg.load_from, cfg.resume = None, False
    cfg.log_level = "WARNING"  # the verdict is the output, not the Runner's config dump
    return Runner.from_cfg(cfg)


def _deepspeed_dtype(cfg: Config) -> torch.dtype | None:
    import json

    ds = (cfg.get("strategy") or {}).get("config")
    if isinstance(ds, str) and Path(ds).is_file():
        ds = json.loads(Path(ds).read_text(encoding="utf-8"))
    if not isinstance(ds, dict):
        return None
    for key, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        if (ds.get(key) or {}).get("enabled") is True:
            return dtype
    return None


def train_dtype(cfg: Config, device: torch.device) -> torch.dtype:
    """The dtype the config trains in on ``device``.

    On CPU: float32 (MMEngine's AMP needs a GPU; the plugin's start-up refuses it there). On a
    GPU: the DeepSpeed config's bf16/fp16, else ``AmpOptimWrapper``'s dtype (float16 when
    unset, MMEngine's default), else the ``llm``'s ``torch_dtype``, else float32.
    """
    if device.type == "cpu":
        return torch.float32
    optim = cfg.get("optim_wrapper") or {}
    llm = (cfg.get("model") or {}).get("llm") or {}
    torch_dtype = llm.get("torch_dtype")
    if _deepspeed_dtype(cfg) is not None:
        return _deepspeed_dtype(cfg)
    if startup.type_name(optim.get("type")) == "AmpOptimWrapper":
        return DTYPES.get(str(optim.get("dtype") or "float16"), torch.float16)
    return torch_dtype if isinstance(torch_dtype, torch.dtype) else torch.float32


def first_batches(cfg: Config, count: int) -> list[tuple[dict, list[list[int]] | None]]:
    """The first ``count`` batches of the config's dataset and collate function, in order.

    Returns:
        ``(data, dataset_boundaries)`` per batch: ``data`` as ``collate_fn`` returns it
        (``{'data': ..., 'data_samples': ...}``), and, for XTuner packs that did not record
        their boundaries (stock ``pack_to_max_length`` without ``use_varlen_attn``), each
        row's boundaries from the same packs built with ``use_varlen_attn=True``; else None.
    """
    from xtuner.registry import BUILDER

    loader = cfg.train_dataloader
    collate_fn, _, _ = build_collate_fn(loader)
    # XTuner's shuffle_before_pack seeds `datasets`' shuffle from numpy's global state: the
    # same state gives the same packs when they are built again with their boundaries.
    state = np.random.get_state()
    dataset = BUILDER.build(loader.dataset)
    batch_size = int(loader.get("batch_size", 1))
    recorded = None
    if (
        len(dataset)
        and "cumulative_len" not in dataset[0]
        and startup.type_name(loader.dataset.get("type")) == "process_hf_dataset"
        and loader.dataset.get("pack_to_max_length", True)
    ):
        np.random.set_state(state)
        recorded = _recorded_packs(loader.dataset, dataset, count * batch_size)
    batches = []
    for i in range(0, min(count * batch_size, len(dataset)), batch_size):
        items = [dataset[j] for j in range(i, min(i + batch_size, len(dataset)))]
        cus = None if recorded is None else [recorded[j] for j in range(i, i + len(items))]
        batches.append((collate_fn(items), cus))
    return batches


def _recorded_packs(dataset_cfg: dict, dataset, n: int) -> list[list[int]]:
    """Boundaries of XTuner's packs, from the same dataset built with ``use_varlen_attn=True``."""
    from xtuner.registry import BUILDER

    varlen_cfg = copy.deepcopy(dataset_cfg)
    varlen_cfg["use_varlen_attn"] = True
    varlen = BUILDER.build(varlen_cfg)
    out = []
    for j in range(min(n, len(dataset))):
        if list(varlen[j]["input_ids"]) != list(dataset[j]["input_ids"]):
            raise ValueError(
                f"xtuner-rope check: pack {j} differs when the dataset records its boundaries "
                "(use_varlen_attn=True): cannot tell where its documents are. Set "
                "train_dataloader.dataset.use_varlen_attn=True (same packs, boundaries "
                "recorded), or enable the plugin, whose start-up does that."
            )
        out.append([int(c) for c in varlen[j]["cumulative_len"]])
    return out


def plugin_hooks(runner) -> dict:
    """The runner's hooks by class name."""
    return {type(h).__name__: h for h in runner.hooks}


def apply_patch(runner, hooks: dict) -> bool:
    """Run the plugin's hooks' ``before_train`` as training does; True if the model was patched.

    ``ValidatedRoPEHook.before_train`` patches the model (the same call as in ``runner.train``);
    ``PackedBatchCheckHook.before_train`` then reads what the model isolates.
    """
    for name in ("ValidatedRoPEHook", "PackedBatchCheckHook"):
        if name in hooks:
            hooks[name].before_train(runner)
    return "ValidatedRoPEHook" in hooks


def measure(runner, batches: list, hooks: dict, new_tokens: int) -> dict:
    """Reference passes (unpatched), the patch, packed passes; see the module docstring.

    Gradients are compared on the first batch (one ``.grad`` buffer holds their difference).
    Dropout and router noise are off in every pass (``check_randomness``: different shapes draw
    different masks); ``randomness`` says what was switched off. ``backend`` is what the patched
    attention chose during the packed passes (``models.runtime.chosen_backends``).
    """
    model = runner.model
    model.train()
    model.zero_grad(set_to_none=True)
    with randomness_off(model) as randomness:
        measured = _measure(runner, batches, hooks, new_tokens)
    return {**measured, "randomness": randomness}


def _measure(runner, batches: list, hooks: dict, new_tokens: int) -> dict:
    model, llm = runner.model, runner.model.llm
    refs = []
    for i, (data_batch, docs) in enumerate(batches):
        data = data_batch["data"]
        n_packed, n_docs = cm.label_count(data["labels"], docs)
        logits, loss = cm.documents_alone(llm, data, docs, n_packed, backward=i == 0)
        refs.append({"logits": logits, "loss": loss, "labels": (n_packed, n_docs)})
    ref_grad = cm.grad_scale(model)
    prompt = cm.prompt_of(batches[0][0]["data"], batches[0][1][0])
    generated_ref = cm.greedy(llm, prompt, new_tokens)
    patched = apply_patch(runner, hooks)
    chosen_backends(reset=True)
    results = []
    for i, ((data_batch, docs), ref) in enumerate(zip(batches, refs)):
        b, s = data_batch["data"]["input_ids"].shape
        logits, loss, dropped = cm.packed_forward(
            runner, data_batch, hooks, BOUNDARY_HOOKS, backward=i == 0
        )
        results.append(
            {
                "rows": b,
                "tokens_per_row": s,
                "documents": len(docs),
                "labels": {"packed": ref["labels"][0], "documents": ref["labels"][1]},
                "logits": cm.logits_differences(logits, ref["logits"], docs),
                "loss": {"packed": loss, "documents": ref["loss"]},
                "unconsumed_keys": dropped,
            }
        )
    diff = cm.grad_scale(model)
    model.zero_grad(set_to_none=True)
    return {
        "patched": patched,
        "backend": ", ".join(chosen_backends(reset=True)) or None,
        "batches": results,
        "grads": {
            "max_abs_diff": diff,
            "max_abs_grad": ref_grad,
            "parameters": sum(p.numel() for p in llm.parameters() if p.requires_grad),
            "batch": 0,
        },
        "generation": {
            "prompt_tokens": prompt.shape[1],
            "unpatched": generated_ref,
            "patched": cm.greedy(llm, prompt, new_tokens),
        },
    }


def report_head(
    cfg: Config,
    config: str,
    cfg_options: dict | None,
    hooks: dict,
    measured: dict,
    llm,
    device,
    dt: torch.dtype,
    *,
    model_class: str,
    parameters: int,
) -> dict:
    """The report's config, plugin and model entries (pops ``patched`` and ``backend``).

    Shared by the text check and the LLaVA check (``llava_check``): what was checked, with the
    attention the language model really ran (the layers' classes and the packed backend chosen).
    """
    return {
        "config": str(config),
        "cfg_options": {k: str(v) for k, v in (cfg_options or {}).items()},
        "plugin": {
            "model_resource": plugin_resource(cfg),
            "patched": measured.pop("patched"),
            "hooks": [n for n in ("ValidatedRoPEHook", *BOUNDARY_HOOKS) if n in hooks],
        },
        "model": {
            "class": model_class,
            "path": str(getattr(llm, "name_or_path", "")),
            "device": str(device),
            "dtype": str(dt).replace("torch.", ""),
            # What picks the layers' class: InternLM2's own config attribute, else HF's.
            "attn_implementation": getattr(llm.config, "attn_implementation", None)
            or getattr(llm.config, "_attn_implementation", None),
            "packed_backend": measured.pop("backend"),
            "attention_layers": sorted(
                {
                    type(m).__name__
                    for m in llm.modules()
                    if type(m).__name__.endswith(("Attention", "Attention2"))
                }
            ),
            "parameters": parameters,
        },
    }


def run_check(
    config: str,
    cfg_options: dict | None = None,
    batches: int = 1,
    work_dir: str | Path = "work_dirs/check",
    dtype: str | None = None,
    max_documents: int = 8,
    new_tokens: int = 8,
) -> dict:
    """Measure isolation and equality on the config's own model and data; see the module doc.

    Memory: one copy of the model, one set of gradients (the reference's are negated into
    ``.grad`` and the packed backward adds to them, so ``.grad`` ends as the difference), the
    reference logits of at most ``max_documents`` documents per batch (on the CPU), and
    activations of one cut batch or one document.

    Args:
        config: XTuner config file.
        cfg_options: ``--cfg-options`` overrides.
        batches: Batches to measure.
        work_dir: Runner work dir (its log goes there).
        dtype: Override of the training dtype (``float32``, ``bfloat16``, ``float16``).
        max_documents: Documents per batch (rows are cut after them).
        new_tokens: Greedy tokens to generate.

    Returns:
        The JSON-ready report, with ``verdict``, ``problems`` and ``exit_code``.
    """
    refuse_unserved_model(config)  # InternVL: refused by the start-up, named
    cfg = start_config(config, cfg_options)
    from xtuner_rope.doctor.check_preference import is_preference_config, run_preference_check

    if is_preference_config(cfg):  # DPO / ORPO / reward model: log-probs and scores
        return run_preference_check(cfg, config, Path(work_dir), dtype)
    from xtuner_rope.doctor.llava_check import run_llava_check

    if is_llava(cfg):  # LLaVAModel: the LLM's logits after the image expansion
        return run_llava_check(
            cfg, config, cfg_options, batches, Path(work_dir), dtype, max_documents, new_tokens
        )
    runner = build_runner(cfg, Path(work_dir))
    device = next(runner.model.parameters()).device
    dt = DTYPES[dtype] if dtype else train_dtype(cfg, device)
    runner.model.to(dt)
    hooks = plugin_hooks(runner)
    cut, sources = [], []
    for data_batch, recorded in first_batches(cfg, batches):
        docs, source = cm.documents(data_batch["data"], recorded, max_documents)
        cut.append((data_batch, docs))
        sources.append(source)
    measured = measure(runner, cut, hooks, new_tokens)
    for result, source in zip(measured["batches"], sources):
        result["boundaries"] = source
    llm = runner.model.llm
    report = {
        **report_head(
            cfg,
            config,
            cfg_options,
            hooks,
            measured,
            llm,
            device,
            dt,
            model_class=type(llm).__name__,
            parameters=sum(p.numel() for p in llm.parameters()),
        ),
        **measured,
    }
    report.update(judge(report))
    return report
