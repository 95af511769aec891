"""The edits that make a stock config run here: local checkpoint and data, CPU, the one edit.

Each edit is a regular expression over the config's text (what a user does in an editor), so
the copied config keeps XTuner's layout. :func:`localize` points every model, data and folder
path setting at local files; :func:`cpu_edits` makes the CPU machine's changes; then the
README's one edit (:func:`enable_plugin`) and a capture hook (:func:`with_capture`).
"""

from __future__ import annotations

import ast
import functools
import io
import re
import tokenize
from dataclasses import dataclass
from pathlib import Path

from tools.zoo.formats import localize_moss
from tools.zoo.internvl import (
    localize_internvl,
    with_internvl_capture,
    with_internvl_collate,
)
from tools.zoo.refcoco import localize_refcoco

# Config-name prefix -> the family's tiny builder name (``demo.tiny.FAMILIES``), longest first.
# A family whose builder is absent from FAMILIES keeps its hub checkpoint id (offline here).
FAMILY_OF_PREFIX = (
    ("internlm2_5", "internlm2"),
    ("internlm2", "internlm2"),
    ("internlm3", "internlm3"),
    ("internlm_", "internlm"),
    ("llama3", "llama"),
    ("llama2", "llama"),
    ("llama_", "llama"),
    ("yi_", "llama"),
    ("deepseek_coder", "llama"),
    ("deepseekcoder", "llama"),
    ("deepseek_moe", "deepseek"),
    ("deepseek_v2", "deepseek_v2"),
    ("zephyr", "mistral"),
    ("mistral", "mistral"),
    ("mixtral", "mixtral"),
    ("qwen1_5_moe", "qwen2_moe"),
    ("qwen1_5", "qwen2"),
    ("qwen2", "qwen2"),
    ("qwen_", "qwen"),
    ("phi3", "phi3"),
    ("gemma", "gemma"),
    ("cohere", "cohere"),
    ("starcoder", "starcoder"),
    ("baichuan", "baichuan"),
    ("chatglm", "chatglm"),
    ("minicpm", "minicpm"),
    ("llava", "llava"),
    ("internvl", "internvl"),
    ("POLAR", "internlm2"),  # InternLM's POLAR reward models: InternLM2 checkpoints
)

PLUGIN_EDIT = (
    "from xtuner_rope import enable_xtuner_rope\nmodel_resource = dict(fn=enable_xtuner_rope)\n"
)
CAPTURE_IMPORT = "from xtuner_rope.capture.text import IsolationCaptureHook\n"
PREFERENCE_KINDS = ("dpo", "orpo", "reward")
# LLaVA config-name prefix -> its LLM's tiny family (``llava_v15``/``vicuna``: Llama).
LLAVA_LLM_OF_PREFIX = (
    ("llava_internlm2", "internlm2"),
    ("llava_llama3", "llama"),
    ("llava_vicuna", "llama"),
    ("llava_v15", "llama"),
    ("llava_phi3", "phi3"),
    ("llava_internlm_", "internlm"),
)
LLAVA_CAPTURE = "from xtuner_rope.capture.llava import LLaVAIsolationCaptureHook\n"
PREFERENCE_CAPTURE = (
    "\nfrom xtuner_rope.capture.preference import "
    "PreferenceCaptureHook  # noqa: E402\n"
    "custom_hooks += [dict(type=PreferenceCaptureHook)]\n"
)


def family_of(name: str) -> str | None:
    """The model family of a stock config name (None when no prefix is known)."""
    return next((fam for prefix, fam in FAMILY_OF_PREFIX if name.startswith(prefix)), None)


def sub(text: str, pattern: str, repl) -> tuple[str, int]:
    """``re.subn`` over lines (``^``/``$`` match at every line)."""
    return re.subn(pattern, repl, text, flags=re.M)


# Settings that name the checkpoint (InternVL configs call it ``path``), and its tokenizer.
MODEL_SETTINGS = ("pretrained_model_name_or_path", "llm_name_or_path", "path", "tokenizer_path")
# ``NAME = "value"`` or ``NAME = (\n    "value"\n)``, with or without trailing comments (a
# noqa comment after a long cluster path, inside the brackets too): group 1 the name, 2 or 3
# the value.
STRING_SETTING = r'^(\w+) = (?:\(\s*\n\s*"([^"\n]*)"[ \t]*(?:#.*)?\n\)|"([^"\n]*)")(?:[ \t]*#.*)?$'
# The value of an inline ``data_files=`` keyword: a string, a one-line or a multi-line list.
DATA_FILES = r'(?:"[^"]*"|\[[^\n]*\]|\[\n(?:.*\n)*?\s*\])'


def is_path_like(value: str) -> bool:
    """A hub id, a relative or absolute path, a URL: what a stock config points at the world."""
    return bool(
        re.fullmatch(r"[^\s<>]*/[^\s<>]*", value)
        or re.fullmatch(r"[^\s<>./][^\s<>]*\.(json|jsonl|parquet)", value)
    ) and value not in ("/", "json")


def model_ids(text: str) -> tuple[str, ...]:
    """The checkpoint ids a config names (:data:`MODEL_SETTINGS`): kept when no tiny one exists."""
    return tuple(
        m.group(2) or m.group(3)
        for m in re.finditer(STRING_SETTING, text, re.M)
        if m.group(1) in MODEL_SETTINGS
    )


def localize_paths(text: str, model: Path | None, data: Path) -> str:
    """Every top-level path setting: model settings to ``model`` (kept without one), every other
    one to the local data folder. Settings built from another (``data_root + "x.json"``) follow
    the one they are built from."""

    def edit(match: re.Match) -> str:
        name, value = match.group(1), match.group(2) or match.group(3)
        if not is_path_like(value) or "prompt" in name:
            return match.group(0)
        if name in MODEL_SETTINGS:
            return match.group(0) if model is None else f'{name} = "{model}"'
        if name == "pretrained_pth":  # a LLaVA pretrain checkpoint nobody has yet
            return "pretrained_pth = None"
        if re.search(r"\.(json|jsonl|parquet)$", value):  # a file setting gets a file
            return f'{name} = "{data / "train.json"}"'
        slash = "/" if value.endswith("/") else ""  # ``data_root + "file.json"`` stays a path
        return f'{name} = "{data}{slash}"'

    text, _ = sub(text, STRING_SETTING, edit)
    text, _ = sub(text, r"^data_files = \[(?:.|\n)*?\]$", f'data_files = ["{data / "train.json"}"]')
    # Inline data settings inside dict(...): a hub dataset, a file list, a sub-folder.
    files = f'"{data / "train.json"}"'
    text, _ = sub(text, rf"^(\s*)data_files={DATA_FILES},", rf"\1data_files=[{files}],")
    text, _ = sub(text, r'data_dir="[^"]*",\s*', "")
    # A hub dataset's configuration name (medical's "finetune") means nothing to a local folder.
    text, _ = sub(text, r"^data_config_name = .*$", "data_config_name = None")
    return sub(text, r'^(\s*)path="[^"]*/[^"]*",', rf'\1path="{data}",')[0]


def localize(text: str, model: Path | None, data: Path, pairs: Path | None = None) -> str:
    """The edits a user makes to run a stock config on this CPU machine with local files.

    Checkpoint path (when a tiny one exists), every dataset path, ``max_length`` 512, no 4-bit
    quantization (bitsandbytes needs CUDA), fp32 ``OptimWrapper`` (AMP needs a GPU), one
    short evaluation prompt, no gradient accumulation, 2 packing workers. With ``pairs`` (a
    preference config), its hub dataset becomes the local pairs file, read by one worker.
    """
    text = localize_paths(text, model, data)
    if pairs is not None:
        text, _ = sub(
            text,
            r'type=load_dataset, path="[^"]+"',
            f'type=load_dataset, path="json", data_files="{pairs}"',
        )
        text, _ = sub(text, rf"^(\s*)data_files={DATA_FILES},", rf'\1data_files=["{pairs}"],')
        text, _ = sub(text, r"^(\s*)num_proc=\d+,$", r"\1num_proc=1,")
    return cpu_edits(text)


def localize_llava(text: str, llm: Path | None, clip: Path, data_json: Path) -> str:
    """A stock LLaVA or InternVL (its checkpoint setting is ``path``) config's own-machine edits
    (``tests/support/llava_configs.py`` makes the same): the LLM and the tiny CLIP, local
    images, batch size 4, no projector checkpoint, a warm-up of at least one of a few
    iterations, no quantization, fp32 ``OptimWrapper`` on CPU."""
    text = localize_paths(text, llm, data_json.parent)  # then the LLaVA-specific settings
    text, _ = sub(
        text, r'^visual_encoder_name_or_path = ".*"$', f'visual_encoder_name_or_path = "{clip}"'
    )
    # Every annotation file (``*data_path``, ``refcoco_path``), not the checkpoints' settings.
    data_file = r"^((?!\w*name_or_path)\w*_path) = (?:\(\n(?:.*\n)*?\).*|.*)$"
    text, _ = sub(text, data_file, rf'\1 = "{data_json}"')
    images = data_json.parent / "images"
    text, _ = sub(text, r"^(\w*image_folder) = .*$", rf'\1 = "{images}"')
    text, _ = sub(text, r"^batch_size = \d+", "batch_size = 4")
    text, _ = sub(text, r"^dataloader_num_workers = \d+", "dataloader_num_workers = 0")
    text, _ = sub(text, r"^warmup_ratio = .*$", "warmup_ratio = 0.3")
    first = sorted(images.iterdir())[0] if images.is_dir() else images / "0.png"
    text, _ = sub(text, r'^evaluation_images = ".*"$', f'evaluation_images = "{first}"')
    text, _ = sub(text, r"^evaluation_inputs = .*$", 'evaluation_inputs = ["What is this?"]')
    return cpu_edits(text)


# New tokens of each chat sample XTuner's ``EvaluateChatHook`` writes on a trial (its default 600,
# at every checkpoint and after training; a randomly initialised tiny model seldom stops early).
CHAT_SAMPLE_TOKENS = 8
# Processes per dataset map on a trial: on a few hundred dialogues XTuner's default 32 worker
# processes cost seconds each to start on a small machine and save nothing.
MAP_PROCESSES = 1


def set_in_dicts(text: str, type_name: str, key: str, value: object) -> str:
    """``key=value`` in every ``dict(type=type_name, ...)`` of a config's text.

    The dicts as XTuner's configs write them: ``type=`` on its own line, one keyword a line at
    its indent, the closing bracket 4 spaces less. A ``key`` already there is set to ``value``
    (never written twice); elsewhere it is added after ``type=``.
    """
    lines, out, i = text.splitlines(keepends=True), [], 0
    head = re.compile(rf"^(\s+)type={re.escape(type_name)},\n$")
    while i < len(lines):
        out.append(lines[i])
        match = head.match(lines[i])
        i += 1
        if not match:
            continue
        indent = match.group(1)
        end = i
        while end < len(lines) and not lines[end].startswith(indent[:-4] + ")"):
            end += 1
        setting, block = f"{indent}{key}={value},\n", lines[i:end]
        found = [line.startswith(f"{indent}{key}=") for line in block]
        block = [setting if hit else line for hit, line in zip(found, block)]
        if not any(found):
            block.insert(0, setting)
        out += block
        i = end
    return "".join(out)


def short_chat_samples(text: str, tokens: int = CHAT_SAMPLE_TOKENS) -> str:
    """``EvaluateChatHook`` generates ``tokens`` new tokens per sample, not its default 600.

    The hook still generates wherever it does (before and after training, at checkpoints).
    """
    return set_in_dicts(text, "EvaluateChatHook", "max_new_tokens", tokens)


def one_map_process(text: str, processes: int = MAP_PROCESSES) -> str:
    """XTuner's ``process_hf_dataset`` maps in ``processes`` processes (its default: 32)."""
    return set_in_dicts(text, "process_hf_dataset", "map_num_proc", processes)


def cpu_edits(text: str) -> str:
    """The CPU machine's edits of :func:`localize` (no path changed)."""
    text, _ = sub(text, r"^max_length = .*$", "max_length = 512")
    text, _ = sub(text, r"^accumulative_counts = .*$", "accumulative_counts = 1")
    text, _ = sub(text, r"^lr = .*$", "lr = 3e-3")
    text, _ = sub(
        text, r"^evaluation_inputs = \[(?:.|\n)*?\]$", 'evaluation_inputs = ["What is 7 plus 5?"]'
    )
    text, _ = sub(
        text,
        r"^(\s*)torch_dtype=torch.float16,\n\s*quantization_config=dict\("
        r"(?:\n.*?)*?\n\1\),\n",
        "",
    )
    text, _ = sub(text, r"^(\s*)quantization_config=dict\((?:\n.*?)*?\n\1\),\n", "")
    text, _ = sub(text, r"^\s*load_in_8bit=True,\n", "")  # int8 LoRA: LoRA without 8-bit
    text = short_chat_samples(one_map_process(text))
    text, amp = sub(text, r"^(\s*)type=AmpOptimWrapper,$", r"\1type=OptimWrapper,")
    if amp:
        text, _ = sub(text, r'^\s*loss_scale="dynamic",\n', "")
        text, _ = sub(text, r'^(\s*)dtype="(float16|bfloat16)",\n(?=(?:.*\n)*?\))', "")
        text, _ = sub(
            text, r"^(from mmengine.optim import .*)\bAmpOptimWrapper\b", r"\1OptimWrapper"
        )
    return text


def enable_plugin(text: str, setting: str = "pretrained_model_name_or_path") -> str:
    """The README's one edit: ``model_resource`` right after the model path in PART 1."""
    text, n = sub(
        text,
        rf"^({setting} = (?:\(\n(?:.*\n)*?\)|.*)\n)",
        lambda m: m.group(1) + PLUGIN_EDIT,
    )
    if n != 1:
        raise ValueError(
            f"zoo: the config has no '{setting} = ...' line: cannot make the README's edit"
        )
    return text


def with_capture(text: str, kind: str = "sft") -> str:
    """``IsolationCaptureHook`` first in ``custom_hooks`` (the run's first batch is saved), or
    for a preference config ``PreferenceCaptureHook`` (its third iteration and weights)."""
    if kind in PREFERENCE_KINDS:
        return text + PREFERENCE_CAPTURE
    text, n = sub(text, r"^(custom_hooks = \[)", r"\g<1>\n    dict(type=IsolationCaptureHook),")
    if n != 1:
        text += "\ncustom_hooks = [dict(type=IsolationCaptureHook)]\n"
    return CAPTURE_IMPORT + text


def enable_plugin_llava(text: str) -> str:
    """The README's one edit after ``llm_name_or_path``, with ``LLaVAIsolationCaptureHook``."""
    text, n = sub(text, r'^(llm_name_or_path = ".*"\n)', lambda m: m.group(1) + PLUGIN_EDIT)
    if n != 1:
        raise ValueError("zoo: the LLaVA config has no 'llm_name_or_path = ...' line")
    text, n = sub(
        text, r"^(custom_hooks = \[)$", r"\g<1>\n    dict(type=LLaVAIsolationCaptureHook),"
    )
    if n != 1:
        text += "\ncustom_hooks = [dict(type=LLaVAIsolationCaptureHook)]\n"
    return LLAVA_CAPTURE + text


@dataclass(frozen=True)
class LocalFiles:
    """What a row is pointed at: its tiny checkpoint (None: no builder, the hub id stays), the
    dialogues folder, the preference pairs file, the tiny CLIP, the LLaVA data JSON, the MOSS
    files (``{tools: path}``, :func:`~tools.zoo.formats.write_moss_data`) and the RefCOCO
    annotations (:func:`~tools.zoo.refcoco.write_refcoco_data`)."""

    model: Path | None
    data: Path
    pairs: Path
    clip: Path
    llava_json: Path
    moss: dict[bool, Path] | None = None
    refcoco: Path | None = None


def localized(text: str, kind: str, files: LocalFiles) -> str:
    """A stock config of ``kind`` (:func:`tools.zoo.classes.kind_of`) pointed at local
    files with the CPU edits, the one edit and the kind's capture hook.

    Raises:
        ValueError: The config has no setting to put the one edit after.
    """
    if kind == "internvl":  # a tiny InternVL, packed, with its capture hook
        text = localize_internvl(cpu_edits(text), files.model, files.llava_json)
        return with_internvl_collate(with_internvl_capture(enable_plugin(text, "path")))
    if kind == "llava":
        text = localize_llava(text, files.model, files.clip, files.llava_json)
        return enable_plugin_llava(localize_refcoco(text, files.refcoco))
    pairs = files.pairs if kind in PREFERENCE_KINDS else None
    text = localize_moss(localize(text, files.model, files.data, pairs), files.moss)
    return with_capture(enable_plugin(text), kind)


@functools.lru_cache(maxsize=2048)
def path_literals(text: str) -> tuple[str, ...]:
    """The path-like string constants of a config's code (comments are not code), except the
    suffixes joined to another setting (``data_root + "x.json"``: they follow ``data_root``)."""
    found, previous = [], ""
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.STRING and previous != "+":
            value = ast.literal_eval(token.string)
            if isinstance(value, str) and is_path_like(value):
                found.append(value)
        if token.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT):
            previous = token.string
    return tuple(found)


def surviving_paths(stock: str, edited: str, kept: tuple[str, ...] = ()) -> list[str]:
    """The stock config's hub ids and paths still in the edited config, except ``kept`` (left on
    purpose: a checkpoint id without a tiny builder here). An empty list: localized completely."""
    left = set(path_literals(edited))
    return sorted({p for p in path_literals(stock) if p in left and p not in kept})
