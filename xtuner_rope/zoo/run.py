"""XTuner's config zoo, swept as a new user meets it: one row per stock config.

For each stock config (``xtuner list-cfg``, filtered by pattern) the sweep

1. copies it with the real ``xtuner copy-cfg``;
2. points it at a tiny random checkpoint of its family, built here
   (:func:`xtuner_rope.demo.tiny.save_tiny`; a family without a tiny builder keeps its hub id,
   so the run shows what happens offline), and at small local data that carries the columns of
   every dataset format XTuner's stock map functions read (alpaca, alpaca_zh, code_alpaca,
   oasst1/pretrain ``text``, OpenAI ``messages``, XTuner ``conversation``);
3. makes the edits of a CPU machine (``tests/stock_configs.py`` localize does the same: no 4-bit
   quantization, fp32 ``OptimWrapper``, short ``max_length``), then the README's one edit
   (``model_resource = dict(fn=enable_xtuner_rope)``) and ``IsolationCaptureHook``;
4. runs ``xtuner-rope doctor`` on it, then a few iterations of the real training script
   (``python -m xtuner.tools.train``, which returns 1 on failure, unlike ``xtuner train``);
5. where it trained, compares each document of the captured first batch with the same document
   alone (:func:`xtuner_rope.doctor.check_capture.compare_capture`).

Each row's outcome is one of :data:`OUTCOMES`, with the doctor's verdict, its reasons, and
whether the doctor predicted it (:func:`doctor_agrees`: exit 0 exactly when the run trains
isolated, and an exit 1 only counts when the doctor named what stopped the run). Preference
configs (DPO, ORPO, reward) run on local pairs and are judged per response against each response
alone. Rows are written to a JSON file as they finish: the sweep resumes where it stopped, and
``only="failed"`` re-runs what did not train isolated or was mispredicted.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

TRAINED = "trained isolated"
REFUSED = "refused before loading"
# Refused after the model loaded, at the first moment the data makes the problem knowable (the
# warm-up rounding of ``xtuner_rope.config.warmup`` needs ``len(train_dataloader)``), never later.
REFUSED_AT_DATA = "refused before training"
LACKS = "needs what this machine lacks"
CRASHED = "crashed"
LEAKED = "leaked"
OUTCOMES = (TRAINED, REFUSED, REFUSED_AT_DATA, LACKS, CRASHED, LEAKED)
# Settings whose refusal needs the built dataset (so it comes after the model has loaded).
DATA_SETTINGS = ("param_scheduler",)

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
)
SHORT_RUN = ("train_cfg.max_epochs=None", "randomness.seed=0", "default_hooks.logger.interval=1")
ISOLATION_TOLERANCE = 1e-5  # fp32: |packed - alone| <= tol * max(1, |logit|)
PLUGIN_EDIT = (
    "from xtuner_rope import enable_xtuner_rope\nmodel_resource = dict(fn=enable_xtuner_rope)\n"
)
CAPTURE_IMPORT = "from xtuner_rope.doctor.check_capture import IsolationCaptureHook\n"
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
LLAVA_CAPTURE = "from xtuner_rope.doctor.llava_capture import LLaVAIsolationCaptureHook\n"
PREFERENCE_CAPTURE = (
    "\nfrom xtuner_rope.doctor.preference_capture import "
    "PreferenceCaptureHook  # noqa: E402\n"
    "custom_hooks += [dict(type=PreferenceCaptureHook)]\n"
)


def family_of(name: str) -> str | None:
    """The model family of a stock config name (None when no prefix is known)."""
    return next((fam for prefix, fam in FAMILY_OF_PREFIX if name.startswith(prefix)), None)


def list_configs(patterns: Iterable[str] = ("*",)) -> list[str]:
    """Stock config names of ``xtuner list-cfg`` matching a glob pattern, in pattern order
    (the first pattern's matches first: the order of the command line is the priority)."""
    from xtuner.configs import cfgs_name_path

    names: list[str] = []
    for pattern in patterns:
        names += [
            n for n in sorted(cfgs_name_path) if fnmatch.fnmatch(n, pattern) and n not in names
        ]
    return names


def mode_of(text: str, name: str) -> dict:
    """Training mode of a stock config: ``tuning`` (full/lora/qlora) and ``packing``."""
    tuning = "qlora" if "qlora" in name else "lora" if "lora" in name else "full"
    if re.search(r"^use_varlen_attn = True", text, re.M):
        packing = "varlen"
    elif re.search(r"^pack_to_max_length = False", text, re.M):
        packing = "unpacked"
    else:
        packing = "packed"
    kind = next(
        (k for k in ("dpo", "orpo", "reward", "llava", "internvl", "pretrain") if k in name), "sft"
    )
    if kind in ("llava", "internvl"):
        packing = "unpacked"  # LLaVADataset hard-codes pack_to_max_length=False
    if kind in PREFERENCE_KINDS and packing == "packed":
        packing = "unpacked"  # build_preference_dataset packs pairs only with use_varlen_attn
    return {"tuning": tuning, "packing": packing, "kind": kind}


# ---------------------------------------------------------------- local data and checkpoints


def write_universal_data(root: Path, n: int = 240) -> Path:
    """One JSON file whose rows carry every column the stock map functions read.

    Returns:
        The directory holding ``train.json`` (``load_dataset(path=dir)`` and
        ``load_dataset("json", data_files=[dir/train.json])`` both read it).
    """
    from xtuner_rope.demo.sample_data import generate_dialogues

    rows = []
    for dialogue in generate_dialogues(n, seed=0):
        msgs = dialogue["messages"]
        system = next((m["content"] for m in msgs if m["role"] == "system"), "")
        users = [m["content"] for m in msgs if m["role"] == "user"]
        replies = [m["content"] for m in msgs if m["role"] == "assistant"]
        turns = [{"input": u, "output": r} for u, r in zip(users, replies)]
        turns[0]["system"] = system
        rows.append(
            {
                "instruction": users[0],
                "input": "",
                "output": replies[0],
                "instruction_zh": users[0],
                "input_zh": "",
                "output_zh": replies[0],
                "prompt": users[0],
                "completion": replies[0],
                "text": f"### Human: {users[0]}### Assistant: {replies[0]}",
                "messages": msgs,
                "conversation": turns,
            }
        )
    root.mkdir(parents=True, exist_ok=True)
    (root / "train.json").write_text(json.dumps(rows), encoding="utf-8")
    return root


def write_preference_data(root: Path, n: int = 240) -> Path:
    """Preference pairs in the stock map function's format (``orpo_dpo_mix_40k_map_fn``:
    ``chosen``/``rejected`` message lists sharing their prompt), as JSON lines.

    Returns:
        The ``.jsonl`` file (``load_dataset("json", data_files=...)`` reads it).
    """
    from xtuner_rope.demo.preference_pairs import preference_pairs, write_pairs
    from xtuner_rope.demo.sample_data import generate_dialogues

    root.mkdir(parents=True, exist_ok=True)
    path = root / "preference_pairs.jsonl"
    write_pairs(preference_pairs(generate_dialogues(n + 1, seed=0), n), str(path))
    return path


def write_llava_images(root: Path) -> Path:
    """12 drawn-image and 12 text dialogues in LLaVA's format; returns the JSON (its images
    under ``images/`` next to it)."""
    from xtuner_rope.demo.llava_data import write_llava_data

    return write_llava_data(root, n_images=12, n_text=12)


def localize_llava(text: str, llm: Path | None, clip: Path, data_json: Path) -> str:
    """A stock LLaVA config's own-machine edits (``tests/llava_configs.py`` makes the same):
    the LLM and the tiny CLIP, local images, batch size 4, no projector checkpoint, a warm-up
    of at least one of a few iterations, no quantization, fp32 ``OptimWrapper`` on CPU."""
    if llm is not None:
        text, _ = _sub(text, r'^llm_name_or_path = ".*"$', f'llm_name_or_path = "{llm}"')
    text, _ = _sub(
        text, r'^visual_encoder_name_or_path = ".*"$', f'visual_encoder_name_or_path = "{clip}"'
    )
    text, _ = _sub(text, r'^pretrained_pth = ".*"(  # noqa: E501)?$', "pretrained_pth = None")
    text, _ = _sub(text, r"^data_path = .*$", f'data_path = "{data_json}"')
    text, _ = _sub(text, r"^image_folder = .*$", f'image_folder = "{data_json.parent / "images"}"')
    text, _ = _sub(text, r"^batch_size = \d+", "batch_size = 4")
    text, _ = _sub(text, r"^dataloader_num_workers = \d+", "dataloader_num_workers = 0")
    text, _ = _sub(text, r"^warmup_ratio = .*$", "warmup_ratio = 0.3")
    first = sorted((data_json.parent / "images").iterdir())[0]
    text, _ = _sub(text, r'^evaluation_images = ".*"$', f'evaluation_images = "{first}"')
    text, _ = _sub(text, r"^evaluation_inputs = .*$", 'evaluation_inputs = ["What is this?"]')
    return cpu_edits(text)


def enable_plugin_llava(text: str) -> str:
    """The README's one edit after ``llm_name_or_path``, with ``LLaVAIsolationCaptureHook``."""
    text, n = _sub(text, r'^(llm_name_or_path = ".*"\n)', lambda m: m.group(1) + PLUGIN_EDIT)
    if n != 1:
        raise ValueError("zoo: the LLaVA config has no 'llm_name_or_path = ...' line")
    text, n = _sub(
        text, r"^(custom_hooks = \[)$", r"\g<1>\n    dict(type=LLaVAIsolationCaptureHook),"
    )
    if n != 1:
        text += "\ncustom_hooks = [dict(type=LLaVAIsolationCaptureHook)]\n"
    return LLAVA_CAPTURE + text


def judge_llava(work: Path, config: Path) -> dict:
    """Each captured sample's LLM logits (after the image expansion) against the sample alone."""
    from xtuner_rope.doctor.llava_capture import LLAVA_CAPTURE_FILE, compare_llava_capture

    capture = work / LLAVA_CAPTURE_FILE
    if not capture.is_file():
        return {"outcome": CRASHED, "message": "trained but saved no LLaVA capture"}
    try:
        result = compare_llava_capture(config, capture)
    except Exception as exc:  # noqa: BLE001 - a row, not the sweep, fails
        return {"outcome": CRASHED, "message": f"LLaVA capture compare: {exc}"[:300]}
    worst = max(s["max_abs_diff"] / max(1.0, s["max_abs_logit"]) for s in result["per_sample"])
    return {
        "documents": result["samples"],
        "relative": worst,
        "dtype": "float32",
        "tolerance": ISOLATION_TOLERANCE,
        "boundaries": "LLaVA samples",
        "outcome": LEAKED if worst > ISOLATION_TOLERANCE else TRAINED,
        "message": f"{result['samples']} image/text samples, max |trained - alone| "
        f"{result['max_abs_diff']:.3g}",
    }


def tiny_checkpoint(family: str | None, models: Path) -> Path | None:
    """The family's tiny checkpoint under ``models`` (built once), or None without a builder."""
    from xtuner_rope.demo.tiny import FAMILIES, save_tiny

    if family not in FAMILIES:
        return None
    out = models / f"tiny-{family}"
    if not (out / "config.json").is_file():
        save_tiny(out, family)
    return out


# ---------------------------------------------------------------- the config edits


def _sub(text: str, pattern: str, repl: str) -> tuple[str, int]:
    return re.subn(pattern, repl, text, flags=re.M)


def localize(text: str, model: Path | None, data: Path, pairs: Path | None = None) -> str:
    """The edits a user makes to run a stock config on this CPU machine with local files.

    Checkpoint path (when a tiny one exists), every dataset path, ``max_length`` 512, no 4-bit
    quantization (bitsandbytes needs CUDA), fp32 ``OptimWrapper`` (AMP needs a GPU), one
    short evaluation prompt, no gradient accumulation, 2 packing workers. With ``pairs`` (a
    preference config), its hub dataset becomes the local pairs file, read by one worker.
    """
    if pairs is not None:
        text, _ = _sub(
            text,
            r'type=load_dataset, path="[^"]+"',
            f'type=load_dataset, path="json", data_files="{pairs}"',
        )
        text, _ = _sub(text, r"^(\s*)num_proc=\d+,$", r"\1num_proc=1,")
    if model is not None:
        text, _ = _sub(
            text,
            r'^pretrained_model_name_or_path = (?:\(\n(?:.*\n)*?\)|".*")$',
            f'pretrained_model_name_or_path = "{model}"',
        )
    for var in re.findall(r'^(\w*(?:path|_en|_zh)\w*) = "[^"]*"$', text, re.M):
        if var != "pretrained_model_name_or_path" and "prompt" not in var:
            text, _ = _sub(text, rf'^{var} = ".*"$', f'{var} = "{data}"')
    text, _ = _sub(text, r"^data_files = \[.*\]$", f'data_files = ["{data / "train.json"}"]')
    return cpu_edits(text)


def cpu_edits(text: str) -> str:
    """The CPU machine's edits of :func:`localize` (no path changed)."""
    text, _ = _sub(text, r"^max_length = .*$", "max_length = 512")
    text, _ = _sub(text, r"^accumulative_counts = .*$", "accumulative_counts = 1")
    text, _ = _sub(text, r"^lr = .*$", "lr = 3e-3")
    text, _ = _sub(
        text, r"^evaluation_inputs = \[(?:.|\n)*?\]$", 'evaluation_inputs = ["What is 7 plus 5?"]'
    )
    text, _ = _sub(
        text,
        r"^(\s*)torch_dtype=torch.float16,\n\s*quantization_config=dict\("
        r"(?:\n.*?)*?\n\1\),\n",
        "",
    )
    text, _ = _sub(text, r"^(\s*)quantization_config=dict\((?:\n.*?)*?\n\1\),\n", "")
    text, _ = _sub(text, r"^\s*load_in_8bit=True,\n", "")  # int8 LoRA: LoRA without 8-bit
    # 2 workers per packing map: the default 32 processes only queue up on a small machine.
    text, _ = _sub(text, r"^(\s*)type=process_hf_dataset,$", r"\g<0>\n\1map_num_proc=2,")
    text, amp = _sub(text, r"^(\s*)type=AmpOptimWrapper,$", r"\1type=OptimWrapper,")
    if amp:
        text, _ = _sub(text, r'^\s*loss_scale="dynamic",\n', "")
        text, _ = _sub(text, r'^(\s*)dtype="(float16|bfloat16)",\n(?=(?:.*\n)*?\))', "")
        text, _ = _sub(
            text, r"^(from mmengine.optim import .*)\bAmpOptimWrapper\b", r"\1OptimWrapper"
        )
    return text


def enable_plugin(text: str) -> str:
    """The README's one edit: ``model_resource`` right after the model path in PART 1."""
    text, n = _sub(
        text,
        r"^(pretrained_model_name_or_path = (?:\(\n(?:.*\n)*?\)|.*)\n)",
        lambda m: m.group(1) + PLUGIN_EDIT,
    )
    if n != 1:
        raise ValueError(
            "zoo: the config has no 'pretrained_model_name_or_path = ...' line: "
            "cannot make the README's edit"
        )
    return text


def with_capture(text: str, kind: str = "sft") -> str:
    """``IsolationCaptureHook`` first in ``custom_hooks`` (the run's first batch is saved), or
    for a preference config ``PreferenceCaptureHook`` (its third iteration and weights)."""
    if kind in PREFERENCE_KINDS:
        return text + PREFERENCE_CAPTURE
    text, n = _sub(text, r"^(custom_hooks = \[)", r"\g<1>\n    dict(type=IsolationCaptureHook),")
    if n != 1:
        text += "\ncustom_hooks = [dict(type=IsolationCaptureHook)]\n"
    return CAPTURE_IMPORT + text


# ---------------------------------------------------------------- running one row


def _env() -> dict:
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
    )
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def _run(cmd: list[str], cwd: Path, timeout: int, log: Path) -> tuple[int, str]:
    try:
        proc = subprocess.run(
            cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout
        )
        code, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        code = 124
        out = f"{exc.stdout or ''}{exc.stderr or ''}\nzoo: timed out after {timeout} s"
    log.write_text(out if isinstance(out, str) else out.decode(errors="replace"), encoding="utf-8")
    return code, out if isinstance(out, str) else out.decode(errors="replace")


def _last_error(out: str) -> str:
    """The last exception line of a log (``SomethingError: ...``), else its last line."""
    lines = [x.strip() for x in out.splitlines() if x.strip()]
    errors = [x for x in lines if re.match(r"^[\w.]*(Error|Exception|Conflict)\b.*:", x)]
    return (errors or lines or ["(no output)"])[-1][:300]


def _refusal(out: str) -> str | None:
    """The start-up's refusal (first named setting), if the log has one."""
    if "ConfigConflict" not in out and "setting(s) of this config would make" not in out:
        return None
    match = re.search(r"^1\. (.*)$", out, re.M)
    return (match.group(1) if match else _last_error(out))[:300]


def refused_settings(out: str) -> list[str]:
    """The settings a refusal lists (``1. setting: problem`` lines of the last refusal)."""
    head = out.rfind("setting(s) of this config would make")
    if head < 0:
        return []
    return re.findall(r"^\d+\. ([^:\n]+):", out[head:], re.M)


def doctor_reasons(report: Path, out: str) -> list[str]:
    """What the doctor named: its conflicts and problems (``setting: problem``), else its error.

    Args:
        report: The doctor's ``report.json`` (absent when it stopped before writing one).
        out: Its console output.
    """
    if report.is_file():
        data = json.loads(report.read_text(encoding="utf-8"))
        found = [
            f"{c['setting']}: {c['problem']}"
            for c in (data.get("findings") or {}).get("conflicts", [])
        ]
        return [x[:400] for x in found + [str(p) for p in data.get("problems", [])]]
    listed = (
        re.findall(r"^\d+\. (.+)$", out[max(out.rfind("setting(s) of this config"), 0) :], re.M)
        if "setting(s) of this config would make" in out
        else []
    )
    return [x[:400] for x in listed] or [_last_error(out)]


def _setting(reason: str) -> str:
    return reason.split(":", 1)[0].strip()


def doctor_agrees(row: dict) -> bool | None:
    """Whether the doctor's verdict equals the row's outcome, reason included.

    Exit 0 is right only for a run that trained isolated. Exit 1 is right only when the doctor
    named what stopped the run: every setting the run refused among the doctor's settings, or a
    crash's (leak's) error text in one of the doctor's reasons. None where the run could not
    show its outcome here (``LACKS``) or the row predates recorded reasons.
    """
    doctor = row.get("doctor") or {}
    if row["outcome"] == LACKS or "exit_code" not in doctor:
        return None
    if doctor["exit_code"] == 0 or row["outcome"] == TRAINED:
        return doctor["exit_code"] == 0 and row["outcome"] == TRAINED
    reasons = doctor.get("reasons")
    if reasons is None:
        return None
    if row["outcome"] in (REFUSED, REFUSED_AT_DATA):
        named = {_setting(r) for r in reasons}
        return bool(row.get("refused")) and set(row["refused"]) <= named
    error = re.sub(r"^[\w.]*(Error|Exception)\b:\s*", "", str(row.get("message", ""))).strip()
    return bool(error) and any(error[:80] in r for r in reasons)


LACK_PATTERNS = (  # (log regex, what this machine lacks)
    (
        r"Torch not compiled with CUDA|CUDA (is )?(not available|driver)|"
        r"requires? (a )?(CUDA|GPU)|CUDA is required|No GPU found|needs a GPU",
        "a CUDA GPU",
    ),
    (r"flash_attn|FlashAttention2 has been toggled on", "flash-attn (CUDA)"),
    (r"contains custom code which must be executed", "the checkpoint's remote code (offline)"),
    (
        r"(offline mode|couldn't connect|is not a local folder|"
        r"does not appear to have a file|We couldn't connect|LocalEntryNotFoundError|"
        r"Cannot find the requested files|OfflineModeIsEnabled|Couldn't reach)",
        "the checkpoint or data from the hub (offline)",
    ),
)


def lacks_of(out: str) -> str | None:
    """What the machine lacks, when the end of the log (the traceback) says so."""
    tail = "\n".join(out.splitlines()[-40:])
    return next((what for pattern, what in LACK_PATTERNS if re.search(pattern, tail)), None)


def judge_run(code: int, out: str, work: Path, config: Path, iters: int, kind: str = "sft") -> dict:
    """The outcome of one training run (see :data:`OUTCOMES`) with its evidence."""
    if code != 0:
        refusal = _refusal(out)
        if refusal:
            return {"outcome": REFUSED, "message": refusal, "refused": refused_settings(out)}
        lacks = lacks_of(out)
        if lacks:
            return {"outcome": LACKS, "message": f"{lacks}: {_last_error(out)}"}
        return {"outcome": CRASHED, "message": _last_error(out)}
    from xtuner_rope.demo.runlog import check_run
    from xtuner_rope.doctor.check_capture import CAPTURE_FILE, compare_capture

    try:
        run = check_run(work, min_iters=iters)
    except RuntimeError as exc:
        return {"outcome": CRASHED, "message": str(exc)[:300]}
    row = {"losses": [round(x, 4) for x in run.losses]}
    if kind in PREFERENCE_KINDS:
        return {**row, **judge_preference(work, config)}
    if kind == "llava":
        return {**row, **judge_llava(work, config)}
    capture = work / CAPTURE_FILE
    if not capture.is_file():
        return {**row, "outcome": CRASHED, "message": "trained but saved no isolation capture"}
    try:
        result = compare_capture(config, capture)
    except Exception as exc:  # noqa: BLE001 - a row, not the sweep, fails
        return {**row, "outcome": CRASHED, "message": f"capture compare: {exc}"[:300]}
    worst = max(d["max_abs_diff"] / max(1.0, d["max_abs_logit"]) for d in result["per_document"])
    dtype = result["dtype"]
    tolerance = isolation_tolerance(dtype)
    row.update(
        documents=result["documents"],
        rows=None,
        max_abs_diff=result["max_abs_diff"],
        relative=worst,
        boundaries=result["boundaries"],
        dtype=dtype,
        tolerance=tolerance,
    )
    in_dtype = "" if dtype == "float32" else f" ({dtype} run, tolerance {tolerance:.3g})"
    if worst > tolerance:
        return {
            **row,
            "outcome": LEAKED,
            "message": f"max |trained - alone| {result['max_abs_diff']:.3g} (relative "
            f"{worst:.3g}){in_dtype}",
        }
    return {
        **row,
        "outcome": TRAINED,
        "message": f"{result['documents']} documents, max |trained - alone| "
        f"{result['max_abs_diff']:.3g}{in_dtype}",
    }


def judge_preference(work: Path, config: Path) -> dict:
    """Each captured response's values (log-probs; the reward token's hidden states) against
    the response alone through the unpatched model, relative to ``max(1, |value|)``."""
    from xtuner_rope.doctor.preference_capture import (
        PREFERENCE_CAPTURE_FILE,
        compare_preference_capture,
    )

    capture = work / PREFERENCE_CAPTURE_FILE
    if not capture.is_file():
        return {"outcome": CRASHED, "message": "trained but saved no preference capture"}
    try:
        result = compare_preference_capture(config, capture)
    except Exception as exc:  # noqa: BLE001 - a row, not the sweep, fails
        return {"outcome": CRASHED, "message": f"preference capture compare: {exc}"[:300]}
    worst = max(
        diff / max(1.0, max(abs(v) for v in result["alone"][name]))
        for name, diff in result["max_abs_diff"].items()
    )
    states = result.get("reward_token_states") or {}
    if states:
        worst = max(worst, states["max_abs_diff"])
    row = {
        "documents": 2 * result["pairs"],
        "relative": worst,
        "dtype": "float32",
        "tolerance": ISOLATION_TOLERANCE,
        "boundaries": "cumulative_len" if result["packed"] else "unpacked (one response a row)",
    }
    control = (
        f"unpatched packed row: {max(result['leak_max_abs_diff'].values()):.3g}"
        if result["packed"]
        else "unpacked: one response a row, nothing to isolate"
    )
    what = (
        f"{result['pairs']} {result['kind']} pairs, responses vs alone relative {worst:.3g}"
        f" ({control})"
    )
    return {**row, "outcome": LEAKED if worst > ISOLATION_TOLERANCE else TRAINED, "message": what}


def isolation_tolerance(dtype: str) -> float:
    """Relative tolerance on the logits of a run in ``dtype``: fp32's, or ``check``'s for a
    half-precision run (``torch_dtype=torch.bfloat16`` configs train in bf16 on CPU too)."""
    from xtuner_rope.doctor.check_report import TOLERANCES

    return ISOLATION_TOLERANCE if dtype == "float32" else TOLERANCES[dtype]["logits"]


def run_row(
    name: str, root: Path, data: Path, models: Path, iters: int = 4, doctor_batches: int = 20
) -> dict:
    """Sweep one stock config; returns its row (never raises for the config's own failure)."""
    start = time.time()
    folder = root / "rows" / name
    shutil.rmtree(folder, ignore_errors=True)  # a re-run never reads an earlier run's files
    folder.mkdir(parents=True)
    family = family_of(name)
    row = {"config": name, "family": family, "date": time.strftime("%Y-%m-%d")}
    copied = subprocess.run(
        ["xtuner", "copy-cfg", name, str(folder)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    stock = folder / f"{name}_copy.py"
    if copied.returncode != 0 or not stock.is_file():
        return {
            **row,
            "outcome": CRASHED,
            "message": "xtuner copy-cfg: " + _last_error(copied.stdout + copied.stderr),
            "seconds": 0,
        }
    text = stock.read_text(encoding="utf-8")
    row["mode"] = mode_of(text, name)
    model = tiny_checkpoint(family, models)
    row["checkpoint"] = "tiny (built here)" if model else "hub id (no tiny builder here)"
    kind = row["mode"]["kind"]
    pairs = root / "data" / "preference_pairs.jsonl" if kind in PREFERENCE_KINDS else None
    if pairs is not None and not pairs.is_file():
        write_preference_data(root / "data")
    try:
        if kind == "llava":
            from xtuner_rope.demo.tiny_clip import save_tiny_clip

            llm_family = next((f for p, f in LLAVA_LLM_OF_PREFIX if name.startswith(p)), None)
            model = tiny_checkpoint(llm_family, models)
            clip = models / "tiny-clip"
            if not (clip / "config.json").is_file():
                save_tiny_clip(clip)
            row["checkpoint"] = f"tiny {llm_family} + tiny CLIP" if model else "hub LLM"
            config_text = enable_plugin_llava(
                localize_llava(text, model, clip, root / "data" / "llava" / "llava_data.json")
            )
        else:
            config_text = with_capture(enable_plugin(localize(text, model, data, pairs)), kind)
    except ValueError as exc:
        return {
            **row,
            "outcome": CRASHED,
            "message": str(exc),
            "doctor": None,
            "seconds": round(time.time() - start),
        }
    config = folder / f"{name}.py"
    config.write_text(config_text, encoding="utf-8")
    code, out = _run(
        [
            sys.executable,
            "-m",
            "xtuner_rope.cli",
            "doctor",
            str(config),
            "--out",
            str(folder / "doctor"),
            "--batches",
            str(doctor_batches),
        ],
        folder,
        600,
        folder / "doctor.log",
    )
    row["doctor"] = {
        "exit_code": code,
        "verdict": _doctor_verdict(out, code),
        "reasons": doctor_reasons(folder / "doctor" / "report.json", out) if code else [],
    }
    work = folder / "work"
    code, out = _run(
        [
            sys.executable,
            "-m",
            "xtuner.tools.train",
            str(config),
            "--work-dir",
            str(work),
            "--cfg-options",
            *SHORT_RUN,
            f"train_cfg.max_iters={iters}",
            # a checkpoint at the end (stock ``save_steps = -1`` configs save none)
            f"default_hooks.checkpoint.interval={iters}",
        ],
        folder,
        900,
        folder / "train.log",
    )
    row.update(judge_run(code, out, work, config, iters, kind))
    if (
        row["outcome"] == REFUSED
        and row["refused"]
        and all(s.startswith(DATA_SETTINGS) for s in row["refused"])
    ):
        row["outcome"] = REFUSED_AT_DATA  # after the model, as soon as the data's length is known
    elif row["outcome"] == REFUSED and _loaded(out):
        row["outcome"], row["message"] = CRASHED, "refused after loading: " + row["message"]
    row["predicted"] = doctor_agrees(row)
    row["seconds"] = round(time.time() - start)
    return row


def _loaded(out: str) -> bool:
    """Whether the log shows weights loaded (a refusal after that is too late)."""
    return bool(re.search(r"Loading checkpoint shards|ValidatedRoPEHook: \d+", out))


def _doctor_verdict(out: str, code: int) -> str:
    lines = [x.strip() for x in out.splitlines() if x.strip()]
    verdict = next((x for x in reversed(lines) if re.match(r"^(OK|FAIL)\b", x)), None)
    return (verdict or _last_error(out))[:300] if code else (verdict or "OK")[:300]


# ---------------------------------------------------------------- the sweep


def load_results(path: Path) -> dict:
    """``{config: row}`` of a results file (empty when absent)."""
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def select(names: list[str], results: dict, only: str) -> list[str]:
    """The configs to run: ``missing`` (not in results), ``failed`` (not trained isolated and
    not refused, or mispredicted by the doctor), or ``all``."""
    if only == "all":
        return names
    if only == "missing":
        return [n for n in names if n not in results]
    if only == "failed":
        return [
            n
            for n in names
            if n in results
            and (
                results[n]["outcome"] in (CRASHED, LEAKED)
                or doctor_agrees(results[n]) is False
                or (doctor_agrees(results[n]) is None and results[n]["outcome"] != LACKS)
            )
        ]
    raise ValueError(f"zoo: only={only!r}: expected one of missing, failed, all")


def sweep(
    patterns: list[str],
    root: Path,
    results_path: Path,
    jobs: int = 1,
    only: str = "missing",
    iters: int = 4,
    models: Path | None = None,
    progress: Callable[[int, int, dict], None] | None = None,
) -> dict:
    """Run the selected rows (``jobs`` at a time), saving the results file after each row.

    Tiny checkpoints are built once per family under ``models`` (default ``root/models``).

    Returns:
        All rows of the results file (the new ones included).
    """
    root = Path(root).resolve()  # each row runs in its own folder: no path may be relative
    root.mkdir(parents=True, exist_ok=True)
    results = load_results(results_path)
    names = select(list_configs(patterns), results, only)
    data = write_universal_data(root / "data")
    write_preference_data(root / "data")  # once, before the workers read it
    write_llava_images(root / "data" / "llava")
    models = Path(models).resolve() if models else root / "models"
    for family in sorted({family_of(n) for n in names} - {None}):
        tiny_checkpoint(family, models)  # once, before the workers race for it
    lock = threading.Lock()
    done = 0
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = {pool.submit(run_row, n, root, data, models, iters): n for n in names}
        for future in as_completed(futures):
            name = futures[future]
            try:
                row = future.result()
            except Exception as exc:  # noqa: BLE001 - the sweep goes on
                row = {"config": name, "outcome": CRASHED, "message": f"zoo: {exc}"[:300]}
            with lock:
                results = load_results(results_path)
                results[name] = row
                results_path.parent.mkdir(parents=True, exist_ok=True)
                tmp = results_path.with_suffix(".tmp")
                tmp.write_text(json.dumps(results, indent=1, sort_keys=True), encoding="utf-8")
                tmp.replace(results_path)
                done += 1
            if progress:
                progress(done, len(names), row)
    return load_results(results_path)


def counts(results: dict) -> dict:
    """Rows per outcome, and the doctor's verdicts judged with their reasons
    (:func:`doctor_agrees`: right, wrong, not comparable)."""
    out = {k: sum(1 for r in results.values() if r["outcome"] == k) for k in OUTCOMES}
    verdicts = [doctor_agrees(r) for r in results.values()]
    out["doctor right"] = sum(1 for v in verdicts if v is True)
    out["doctor wrong"] = sum(1 for v in verdicts if v is False)
    return out


def markdown(results: dict) -> str:
    """The results as a markdown table (one row per config, sorted), with the counts."""
    lines = [
        "| config | family | mode | outcome | detail | doctor | doctor = outcome |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in sorted(results):
        r = results[name]
        mode = r.get("mode") or {}
        mode_s = "/".join(str(mode[k]) for k in ("kind", "tuning", "packing") if k in mode)
        doctor = r.get("doctor") or {}
        pred = {True: "yes", False: "**no**", None: "n/a"}[doctor_agrees(r)]
        detail = str(r.get("message", "")).replace("|", "\\|").replace("\n", " ")[:160]
        said = "; ".join(doctor.get("reasons") or [])
        said = f": {said}".replace("|", "\\|").replace("\n", " ")[:120] if said else ""
        lines.append(
            f"| {name} | {r.get('family')} | {mode_s} | {r['outcome']} | {detail} | "
            f"exit {doctor.get('exit_code', '-')}{said} | {pred} |"
        )
    c = counts(results)
    lines += [
        "",
        "Counts: " + ", ".join(f"{k} {v}" for k, v in c.items()) + f" (of {len(results)} configs).",
    ]
    return "\n".join(lines) + "\n"
