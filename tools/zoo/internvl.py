"""The zoo's InternVL rows: a tiny InternVL checkpoint per LLM and a stock config's edits.

XTuner's InternVL configs (``model.type=InternVL_V1_5``) name the checkpoint ``path`` and read
LLaVA-format data (``data_path``, ``image_folder``). A row trains a tiny InternVL
(:func:`internvl_checkpoint`: ``demo.tiny_internvl`` around the tiny InternLM2, with the hub's
remote code as real InternLM2 checkpoints ship it, or the tiny Phi-3) on the sweep's LLaVA data,
with the user's own-machine edits (:func:`localize_internvl`, which
``tests/support/internvl_configs.py`` uses too), the README's one edit after ``path = ...``,
:class:`~xtuner_rope.capture.internvl.InternVLIsolationCaptureHook` and the plugin's packing
collate (:func:`with_internvl_collate`: rows of several whole samples, so isolation is exercised).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

INTERNVL_CAPTURE = "from xtuner_rope.capture.internvl import InternVLIsolationCaptureHook\n"
PACKING_IMPORT = "from xtuner_rope import internvl_collate_fn\n"


def internvl_llm_of(name: str) -> str | None:
    """The tiny LLM family of a stock InternVL config (``*internlm2*``, ``internlm2_5`` too:
    InternLM2; ``*phi3*``: Phi-3), None for another."""
    if "phi3" in name:
        return "phi3"
    return "internlm2" if "internlm2" in name else None


def sub_once(text: str, pattern: str, repl: str) -> str:
    """``re.sub`` over lines that must match exactly once.

    Raises:
        ValueError: The pattern matched zero or several times (the stock layout changed).
    """
    new, count = re.subn(pattern, repl, text, flags=re.M)
    if count != 1:
        raise ValueError(
            f"zoo: the InternVL config edit {pattern!r} matched {count} times, expected 1"
        )
    return new


def localize_internvl(
    text: str, model: Path | None, data_json: Path, batch_size: int = 4, lr: str = "1e-3"
) -> str:
    """A stock InternVL config's own-machine edits (no CPU optimizer swap); returns the text.

    ``path`` (kept when ``model`` is None), the LLaVA-format data and its images, ``max_length``
    512, ``batch_size``, no loader workers, a learning rate for a tiny model, one optimizer
    step per iteration, a warm-up of at least one of a few iterations, and no 4-bit
    quantization (QLoRA configs: ``quantization_llm``/``quantization_vit`` False; the start-up
    refuses 4-bit on CPU, and bitsandbytes needs CUDA).

    Raises:
        ValueError: A setting is missing or repeated (:func:`sub_once`).
    """
    if model is not None:
        text = sub_once(text, r'^path = ".*"$', f'path = "{model}"')
    text = sub_once(text, r"^data_root = .*$", f'data_root = "{data_json.parent}/"')
    text = sub_once(text, r"^data_path = .*$", f'data_path = "{data_json}"')
    text = sub_once(text, r"^image_folder = .*$", f'image_folder = "{data_json.parent / "images"}"')
    text = sub_once(text, r"^max_length = .*$", "max_length = 512")
    text = sub_once(text, r"^batch_size = \d+", f"batch_size = {batch_size}")
    text = sub_once(text, r"^dataloader_num_workers = \d+", "dataloader_num_workers = 0")
    text = sub_once(text, r"^lr = .*$", f"lr = {lr}")
    text = sub_once(text, r"^accumulative_counts = \d+", "accumulative_counts = 1")
    text = sub_once(text, r"^warmup_ratio = .*$", "warmup_ratio = 0.3")
    for key in ("quantization_llm", "quantization_vit"):
        if f"{key}=True" in text:
            text = sub_once(text, rf"{key}=True", f"{key}=False")
    return text


def with_internvl_capture(text: str) -> str:
    """``InternVLIsolationCaptureHook`` first in ``custom_hooks``: iteration 1 is saved."""
    text = sub_once(
        text, r"^(custom_hooks = \[)$", r"\g<1>\n    dict(type=InternVLIsolationCaptureHook),"
    )
    return sub_once(text, r"^(from xtuner.utils import .*\n)", r"\g<1>" + INTERNVL_CAPTURE)


def with_internvl_collate(text: str, max_length: int = 512) -> str:
    """Pack whole samples into rows: ``internvl_collate_fn`` instead of ``default_collate_fn``
    (the docs' packing edit for InternVL)."""
    text = sub_once(
        text,
        r"collate_fn=dict\(type=default_collate_fn\)",
        f"collate_fn=dict(type=internvl_collate_fn, max_length={max_length})",
    )
    return sub_once(
        text,
        r"^(from xtuner.dataset.collate_fns import default_collate_fn\n)",
        r"\g<1>" + PACKING_IMPORT,
    )


def with_remote_code(llm: Path, out: Path) -> Path:
    """A copy of the tiny InternLM2 at ``out`` as hub checkpoints ship it: its modeling code
    (the hub version XTuner ships in ``xtuner._lite.modelings.internlm2``) and an ``auto_map``,
    so ``trust_remote_code=True`` loads it as it loads a real one."""
    import xtuner._lite.modelings.internlm2 as code

    from xtuner_rope.models.checkpoint_config import read_checkpoint_config

    if (out / "config.json").is_file():
        return out
    shutil.copytree(llm, out, dirs_exist_ok=True)
    for name in ("configuration_internlm2.py", "modeling_internlm2.py"):
        shutil.copy(Path(code.__file__).parent / name, out / name)
    config = dict(read_checkpoint_config(str(out)).data)
    config["auto_map"] = {
        "AutoConfig": "configuration_internlm2.InternLM2Config",
        "AutoModelForCausalLM": "modeling_internlm2.InternLM2ForCausalLM",
    }
    (out / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return out


def internvl_checkpoint(llm: str | None, models: Path) -> Path | None:
    """The tiny InternVL around the tiny ``llm`` (``internlm2`` or ``phi3``) under ``models``,
    built once; None for another LLM."""
    from tools.zoo.data import tiny_checkpoint
    from xtuner_rope.demo.tiny_internvl import save_tiny_internvl

    if llm not in ("internlm2", "phi3"):
        return None
    out = models / f"tiny-internvl2-{llm}"
    if (out / "config.json").is_file():
        return out
    base = tiny_checkpoint(llm, models)
    if llm == "internlm2":
        base = with_remote_code(base, models / "tiny-internlm2-remote")
    return save_tiny_internvl(base, out)
