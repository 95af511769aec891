"""The classes of XTuner's config zoo, read from each config's text alone (nothing is run).

A config has one value on each *axis* below; a *class* is one value of one axis (``packing:
sft/varlen``, ``data: alpaca_map_fn``). The axes are the settings that change what the plugin
does: which model code it patches (kind and family), how batches carry documents (packing),
what wraps the model (tuning), what builds the data (builder and map function), how the run is
launched (sequence parallel, sampler, DeepSpeed), and the model settings the start-up rewrites
or refuses. Axes are crossed only where the combination takes another code path (the family
with the kind: LLaVA's LLM is patched through another wrapper); crossing every axis would count
strings, not behaviours. A class is *covered* when a swept row of it ended in a way that shows
what the plugin does there (:data:`COVERING`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from tools.zoo.judge import (
    LACKS,
    NOT_A_TRAINING_CONFIG,
    NOT_EXERCISED,
    REFUSED,
    REFUSED_AT_DATA,
    TRAINED,
)
from tools.zoo.localize import LLAVA_LLM_OF_PREFIX, family_of

# Outcomes that show what the plugin does in a class. "Not exercised" covers only where the
# class itself has nothing to isolate (one document a row): a packed row that happened to hold
# one document proves nothing.
COVERING = (TRAINED, REFUSED, REFUSED_AT_DATA, LACKS, NOT_A_TRAINING_CONFIG)
KIND_OF_MODEL = {
    "SupervisedFinetune": "sft",
    "DPO": "dpo",
    "ORPO": "orpo",
    "RewardModel": "reward",
    "LLaVAModel": "llava",
    "InternVL_V1_5": "internvl",
}
AXES = ("kind", "family", "packing", "tuning", "builder", "data", "launch", "model settings")


def kind_of(text: str, name: str = "") -> str:
    """What trains: ``sft``, ``dpo``, ``orpo``, ``reward``, ``llava``, ``internvl``,
    ``hf_trainer`` (``framework = "huggingface"``), ``deepspeed_json`` (a ``--deepspeed``
    file) or ``script`` (a conversion script shipped beside the configs)."""
    if name.startswith("deepspeed_") or text.lstrip().startswith("{"):
        return "deepspeed_json"
    if re.search(r'^framework = "huggingface"', text, re.M):
        return "hf_trainer"
    model = re.search(r"^model = dict\(\s*\n\s*type=(\w+)", text, re.M)
    return KIND_OF_MODEL.get(model.group(1), model.group(1)) if model else "script"


def llm_family(text: str, name: str, kind: str) -> str:
    """The LLM's family: by name prefix; a LLaVA's by its LLM prefix, an InternVL's by the LLM
    its name carries (its checkpoint is hub remote code either way)."""
    if kind == "llava":
        return next((f for p, f in LLAVA_LLM_OF_PREFIX if name.startswith(p)), "llava (hub LLM)")
    if kind == "internvl":
        return next((f for f in ("internlm2", "phi3") if f in name), "internvl (hub LLM)")
    return family_of(name) or "unknown"


def packing_of(text: str, kind: str) -> str:
    """How a batch carries documents: ``varlen``, ``packed`` (one position range: the plugin
    rebuilds the boundaries), ``offline packed`` (XTuner's intern-repo packed dataset),
    ``unpacked`` (one document a row)."""
    if kind in ("llava", "internvl"):
        return "unpacked"  # LLaVADataset hard-codes pack_to_max_length=False; so does InternVL's
    if re.search(r"^use_varlen_attn = True", text, re.M):
        return "varlen"
    if "type=build_packed_dataset" in text:
        return "offline packed"
    if kind in ("dpo", "orpo", "reward"):
        return "unpacked"  # build_preference_dataset packs pairs only with use_varlen_attn
    if re.search(r"^pack_to_max_length = False", text, re.M):
        return "unpacked"
    if "type=MOSSSFTDataset" in text and "type=process_hf_dataset" not in text:
        return "unpacked"  # one tokenized dialogue an item, never packed
    return "packed"


def tuning_of(text: str) -> str:
    """``full``, ``lora``, ``qlora`` (4-bit), ``int8 lora``; an adapter on the LLM only."""
    lora = bool(re.search(r"^\s*(llm_)?lora ?= ?dict\(", text, re.M))
    if re.search(r"load_in_4bit=True|quantization_llm=True", text):
        return "qlora" if lora else "4-bit"
    if re.search(r"load_in_8bit=True", text):
        return "int8 lora" if lora else "int8"
    return "lora" if lora else "full"


def builders_of(text: str) -> list[str]:
    """The dataset builders: ``process_hf_dataset``, ``MOSSSFTDataset``, ``ConcatDataset``..."""
    found = set(re.findall(r"^\s*type=(\w*(?:[dD]ataset)\w*),", text, re.M))
    return sorted(found - {"load_dataset", "load_jsonl_dataset"}) or ["none"]


def data_of(text: str) -> list[str]:
    """The data formats: the dataset map functions (``None``: already in XTuner's format)."""
    return sorted(set(re.findall(r"dataset_map_fn=(\w+)", text))) or ["no map function"]


def launch_of(text: str) -> str:
    """What the launch needs: sequence parallel (XTuner trains it only under DeepSpeed), a
    sampler that needs DeepSpeed's data-parallel group, or nothing special."""
    sp = re.search(r"^sequence_parallel_size = (\d+)", text, re.M)
    if sp and int(sp.group(1)) > 1:
        return "sequence parallel > 1 (DeepSpeed)"
    if "type=InternRepoSampler" in text:
        return "InternRepoSampler (DeepSpeed data-parallel group)"
    if re.search(r"type=LengthGroupedSampler", text):
        return "LengthGroupedSampler"
    if re.search(r"batch_sampler=dict\(\s*type=BatchSampler", text):
        return "BatchSampler"
    return "one process, default sampler"


def model_settings_of(text: str) -> str:
    """Model settings the start-up rewrites, judges by or refuses: attention implementation,
    weights dtype of a full run, packed rows in batches of more than one."""
    found = []
    if 'attn_implementation="flash_attention_2"' in text:
        found.append("flash_attention_2")
    dtype = re.search(r"torch_dtype=torch\.(bfloat16|float32)", text)
    if dtype:
        found.append(f"weights {dtype.group(1)}")
    batch = re.search(r"^batch_size = (\d+)", text, re.M)
    packed = not re.search(r"^pack_to_max_length = False", text, re.M)
    if batch and int(batch.group(1)) > 1 and packed and "default_collate_fn" in text:
        found.append("packed rows, batch size > 1")
    return ", ".join(found) or "none"


def classify(name: str, text: str) -> dict[str, str | list[str]]:
    """The config's value on every axis (:data:`AXES`; the data axes list every builder and
    map function a config combines); a non-training file has its kind only."""
    kind = kind_of(text, name)
    if kind in ("deepspeed_json", "script"):
        return {"kind": kind}
    family = llm_family(text, name, kind)
    return {
        "kind": kind,
        "family": f"{kind}/{family}",
        "packing": f"{kind}/{packing_of(text, kind)}",
        "tuning": f"{kind}/{tuning_of(text)}",
        "builder": builders_of(text),
        "data": data_of(text),
        "launch": launch_of(text),
        "model settings": model_settings_of(text),
    }


def mode_of(text: str, name: str) -> dict:
    """A row's short mode: ``kind``, ``tuning`` (full/lora/qlora...) and ``packing``."""
    kind = kind_of(text, name)
    if kind in ("deepspeed_json", "script"):
        return {"kind": kind}
    return {"tuning": tuning_of(text), "packing": packing_of(text, kind), "kind": kind}


def zoo_classes(texts: dict[str, str]) -> dict[tuple[str, str], list[str]]:
    """``{(axis, class): [config, ...]}`` over ``{config: text}``."""
    out: dict[tuple[str, str], list[str]] = {}
    for name in sorted(texts):
        for axis, values in classify(name, texts[name]).items():
            for value in [values] if isinstance(values, str) else values:
                out.setdefault((axis, value), []).append(name)
    return out


def covers(row: dict) -> bool:
    """Whether a swept row shows what the plugin does in its classes (see :data:`COVERING`)."""
    if row.get("outcome") in COVERING:
        return True
    packing = (row.get("mode") or {}).get("packing")
    return row.get("outcome") == NOT_EXERCISED and packing == "unpacked"


def coverage(
    classes: dict[tuple[str, str], list[str]], results: dict
) -> list[tuple[str, str, int, list[str], list[str]]]:
    """Per class: ``(axis, class, configs, covering rows, other swept rows)``."""
    table = []
    for (axis, value), names in sorted(classes.items()):
        swept = [n for n in names if n in results]
        good = [n for n in swept if covers(results[n])]
        table.append((axis, value, len(names), good, [n for n in swept if n not in good]))
    return table


def stock_texts(names: Iterable[str] | None = None) -> dict[str, str]:
    """``{config: text}`` of the installed XTuner's stock configs (``xtuner list-cfg``)."""
    from xtuner.configs import cfgs_name_path

    wanted = set(names) if names is not None else set(cfgs_name_path)
    return {n: open(p, encoding="utf-8").read() for n, p in cfgs_name_path.items() if n in wanted}
