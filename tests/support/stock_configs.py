"""XTuner's stock configs as a user gets them (`xtuner copy-cfg`), pointed at local files.

``copy_stock`` writes what ``xtuner copy-cfg`` writes (the zoo's step 1); ``localize`` makes the
edits any user makes to run a stock config on their own machine and data (checkpoint path, data
path, a shorter ``max_length``, a learning rate that moves a randomly initialised tiny model, and
on a CPU-only machine fp32 ``OptimWrapper`` instead of ``AmpOptimWrapper``); ``enable_plugin`` makes the one
edit the README documents. Each edit is a text substitution that must match exactly once, so a
change of XTuner's stock files fails loudly here instead of testing something else.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from tools.zoo.localize import one_map_process, short_chat_samples

# What ``xtuner copy-cfg NAME DST`` writes, in this process (the zoo's step 1: the command's
# process costs ~4 s of CPU for a file copy, and the suite copies dozens of configs).
from tools.zoo.run import copy_stock  # noqa: F401

REPO = Path(__file__).resolve().parents[2]
TINY_MODEL = REPO / "models" / "tiny-internlm2"
SAMPLE_DATA = REPO / "data" / "short_dialogues.jsonl"
PLUGIN_EDIT = (
    "from xtuner_rope import enable_xtuner_rope\nmodel_resource = dict(fn=enable_xtuner_rope)\n"
)


def venv_env() -> dict:
    """The environment `xtuner train` needs: this interpreter's bin first on PATH."""
    return dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")


def sub_once(text: str, pattern: str, repl: str) -> str:
    """``re.sub`` that must match exactly once (multiline)."""
    new, count = re.subn(pattern, repl, text, flags=re.M)
    if count != 1:
        raise AssertionError(f"stock config edit {pattern!r} matched {count} times, expected 1")
    return new


def _turns(n: int):
    """(system, [user, ...], [assistant, ...]) of the first ``n`` sample dialogues."""
    with open(SAMPLE_DATA, encoding="utf-8") as f:
        for line, _ in zip(f, range(n)):
            msgs = json.loads(line)["messages"]
            system = next((m["content"] for m in msgs if m["role"] == "system"), "")
            yield (
                system,
                [m["content"] for m in msgs if m["role"] == "user"],
                [m["content"] for m in msgs if m["role"] == "assistant"],
            )


def write_alpaca_data(dst: Path, n: int = 400) -> Path:
    """The sample dialogues' first exchange in alpaca format, in a directory for load_dataset."""
    rows = [
        {"instruction": users[0], "input": "", "output": replies[0]}
        for _, users, replies in _turns(n)
    ]
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "train.json").write_text(json.dumps(rows), encoding="utf-8")
    return dst


def write_message_lines(dst: Path, n: int = 400) -> Path:
    """The alpaca data's dialogues (first exchange) as intern-repo untokenized lines.

    One JSON list of OpenAI messages a line in ``dst/dialogues.json``, the format
    ``load_intern_repo_untokenized_dataset`` reads from its ``folder``; returns ``dst``.
    """
    lines = [
        json.dumps([{"role": "user", "content": u[0]}, {"role": "assistant", "content": r[0]}])
        for _, u, r in _turns(n)
    ]
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "dialogues.json").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return dst


INTERN_REPO = "internlm2_7b_w_untokenized_dataset"


def intern_repo_config(dst: Path, n: int = 600) -> Path:
    """Stock ``internlm2_7b_w_untokenized_dataset`` with the one edit, on ``n`` of the alpaca
    data's dialogues (:func:`write_message_lines`), the tiny checkpoint and ``max_length``
    512 (the zoo's own-machine edits); returns the config's path (``dst/intern_repo.py``)."""
    from tools.zoo.localize import enable_plugin as zoo_enable_plugin
    from tools.zoo.localize import localize as zoo_localize

    stock = copy_stock(INTERN_REPO, dst).read_text(encoding="utf-8")
    data = write_message_lines(dst / "intern_repo_data", n)
    path = dst / "intern_repo.py"
    path.write_text(zoo_enable_plugin(zoo_localize(stock, TINY_MODEL, data)), encoding="utf-8")
    return path


def write_conversation_data(dst: Path, n: int = 400) -> Path:
    """The sample dialogues in XTuner's ``conversation`` format (custom-dataset configs)."""
    rows = []
    for system, users, replies in _turns(n):
        turns = [{"input": u, "output": r} for u, r in zip(users, replies)]
        turns[0]["system"] = system
        rows.append({"conversation": turns})
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text(json.dumps(rows), encoding="utf-8")
    return dst


def localize(
    config: Path,
    data: Path,
    cpu: bool = True,
    lora_only: bool = False,
    model: Path = TINY_MODEL,
    map_num_proc: int | None = 1,
) -> str:
    """The user's own-machine edits of a stock InternLM2 config; returns the new text.

    Also the trial's cheap settings: ``EvaluateChatHook`` samples of a few tokens
    (``zoo.localize.short_chat_samples``) and ``map_num_proc`` processes per dataset map
    (None keeps XTuner's default of 32, for the test of what the plugin says about it).
    """
    text = config.read_text(encoding="utf-8")
    text = sub_once(
        text,
        r'^pretrained_model_name_or_path = ".*"$',
        f'pretrained_model_name_or_path = "{model}"',
    )
    if "alpaca_en_path = " in text:
        text = sub_once(text, r'^alpaca_en_path = ".*"$', f'alpaca_en_path = "{data}"')
    else:
        text = sub_once(text, r"^data_files = \[.*\]$", f'data_files = ["{data}"]')
    text = sub_once(text, r"^max_length = \d+$", "max_length = 512")
    text = sub_once(text, r"^lr = .*$", "lr = 3e-3")
    text = sub_once(text, r"^accumulative_counts = \d+", "accumulative_counts = 1")
    text = sub_once(text, r"^evaluation_inputs = .*$", 'evaluation_inputs = ["What is 7 plus 5?"]')
    text = short_chat_samples(text)
    if map_num_proc is not None:
        text = one_map_process(text, map_num_proc)
    if lora_only:  # LoRA without 4-bit quantization: bitsandbytes' kernels need CUDA
        text = sub_once(
            text,
            r"^        torch_dtype=torch.float16,\n        quantization_config="
            r"dict\((\n.*?)*?\n        \),\n",
            "",
        )
    if cpu:
        text = cpu_optim_wrapper(text)
    return text


def enable_plugin(text: str) -> str:
    """The README's one edit: ``model_resource`` in PART 1, after the model path."""
    return sub_once(text, r'^(pretrained_model_name_or_path = ".*"\n)', r"\g<1>" + PLUGIN_EDIT)


def xtuner_train(
    config: Path, work_dir: Path, *cfg_options: str, timeout: int = 900
) -> subprocess.CompletedProcess:
    """The real ``xtuner train`` from the repository root (it exits 0 even on failure)."""
    cmd = ["xtuner", "train", str(config), "--work-dir", str(work_dir)]
    if cfg_options:
        cmd += ["--cfg-options", *cfg_options]
    return subprocess.run(
        cmd, cwd=REPO, env=venv_env(), capture_output=True, text=True, timeout=timeout
    )


def tiny_with_remote_code(dst: Path) -> Path:
    """The tiny checkpoint as real InternLM2 checkpoints ship: with its own modeling code.

    Real checkpoints carry ``modeling_internlm2.py`` and an ``auto_map`` in ``config.json``,
    so ``trust_remote_code=True`` loads them without xtuner-rope's Auto registration; this
    copy uses the modeling code XTuner ships (the current hub version).
    """

    from xtuner_rope.demo.tiny import add_internlm2_remote_code

    shutil.copytree(TINY_MODEL, dst)
    return add_internlm2_remote_code(dst)


def ensure_tiny_model() -> Path:
    """Build the tiny checkpoint where a fresh clone has none (deterministic, offline)."""
    from xtuner_rope.demo.resources import tiny_checkpoint

    return Path(tiny_checkpoint(str(TINY_MODEL), data_path=str(SAMPLE_DATA)))


CAPTURE_IMPORT = "from xtuner_rope.capture.text import IsolationCaptureHook\n"


def with_capture(text: str) -> str:
    """Add ``IsolationCaptureHook`` (first in ``custom_hooks``): iteration 1 is saved."""
    text = sub_once(text, r"^(custom_hooks = \[)$", r"\g<1>\n    dict(type=IsolationCaptureHook),")
    return sub_once(text, r"^(from xtuner.utils import .*\n)", r"\g<1>" + CAPTURE_IMPORT)


def assert_isolated_in_run(config: Path, work_dir: Path) -> dict:
    """Each document of the run's first batch, as trained, equals the document alone (fp32)."""
    from xtuner_rope.capture.text import CAPTURE_FILE, compare_capture

    result = compare_capture(config, work_dir / CAPTURE_FILE)
    assert result["documents"] > 1, result
    for doc in result["per_document"]:
        assert doc["max_abs_diff"] <= 1e-5 * max(1.0, doc["max_abs_logit"]), doc
    assert abs(result["loss"]["captured"] - result["loss"]["documents"]) <= 1e-5, result["loss"]
    print(
        f"{config.stem}: {result['documents']} documents, max |trained - alone| "
        f"{result['max_abs_diff']:.3g}"
    )
    return result


def cpu_optim_wrapper(text: str) -> str:
    """The README's CPU edit: fp32 ``OptimWrapper`` instead of ``AmpOptimWrapper``."""
    text = sub_once(text, r"^    type=AmpOptimWrapper,$", "    type=OptimWrapper,")
    text = sub_once(text, r'^    loss_scale="dynamic",\n(    dtype="(float16|bfloat16)",\n)?', "")
    return sub_once(
        text,
        r"^from mmengine.optim import AmpOptimWrapper,",
        "from mmengine.optim import OptimWrapper,",
    )
