"""XTuner's stock InternVL configs as a user gets them (``xtuner copy-cfg``), pointed at local files.

The edits any user makes to run a stock InternVL config on their own machine: ``path`` (the
InternVL checkpoint, here the tiny one of ``demo.tiny_internvl``), the data, ``max_length``
512, batch 4, a learning rate for a tiny model, one optimizer step per iteration, no 4-bit
quantization on CPU, and on a CPU-only machine fp32 ``OptimWrapper`` instead of
``AmpOptimWrapper`` (the README's swap). ``enable_plugin_internvl`` makes the README's one edit
after ``path = ...``. Each edit must match exactly once (``stock_configs.sub_once``).
"""

from __future__ import annotations

from pathlib import Path

from stock_configs import PLUGIN_EDIT, cpu_optim_wrapper, sub_once

INTERNLM2_LORA = "internvl_v2_internlm2_2b_lora_finetune"
PHI3_FULL = "internvl_v2_phi3_4b_finetune"


def localize_internvl(
    config: Path, model: Path, data_json: Path, batch_size: int = 4, cpu: bool = True
) -> str:
    """The user's own-machine edits of a stock InternVL config; returns the new text."""
    text = config.read_text(encoding="utf-8")
    text = sub_once(text, r'^path = ".*"$', f'path = "{model}"')
    text = sub_once(text, r"^data_root = .*$", f'data_root = "{data_json.parent}/"')
    text = sub_once(text, r"^data_path = .*$", f'data_path = "{data_json}"')
    text = sub_once(text, r"^image_folder = .*$", f'image_folder = "{data_json.parent / "images"}"')
    text = sub_once(text, r"^max_length = .*$", "max_length = 512")
    text = sub_once(text, r"^batch_size = \d+", f"batch_size = {batch_size}")
    text = sub_once(text, r"^dataloader_num_workers = \d+", "dataloader_num_workers = 0")
    text = sub_once(text, r"^lr = .*$", "lr = 1e-3")
    text = sub_once(text, r"^accumulative_counts = \d+", "accumulative_counts = 1")
    text = sub_once(text, r"^warmup_ratio = .*$", "warmup_ratio = 0.3")  # >= 1 of few iterations
    for key in ("quantization_llm", "quantization_vit"):
        if f"{key}=True" in text:
            text = sub_once(text, rf"{key}=True", f"{key}=False")
    if cpu:
        text = cpu_optim_wrapper(text)
    return text


def enable_plugin_internvl(text: str) -> str:
    """The README's one edit, after the config's ``path = ...`` line."""
    return sub_once(text, r'^(path = ".*"\n)', r"\g<1>" + PLUGIN_EDIT)


_ASSETS: dict = {}


def internvl_assets(root: Path) -> dict:
    """Tiny InternVL checkpoints around a tiny InternLM2 (hub-style remote code) and a tiny
    Phi-3, LLaVA-format data (8 drawn images + 8 short text-only dialogues) and the two
    stock configs copied with ``xtuner copy-cfg``, under ``root``."""
    if _ASSETS:  # one set per test session (the doctor and the integration tests share it)
        return _ASSETS
    from stock_configs import copy_stock, ensure_tiny_model, tiny_with_remote_code

    from xtuner_rope.demo.llava_data import write_llava_data
    from xtuner_rope.demo.tiny import save_tiny
    from xtuner_rope.demo.tiny_internvl import save_tiny_internvl

    ensure_tiny_model()
    internlm2 = tiny_with_remote_code(root / "tiny-internlm2-remote")
    phi3 = save_tiny(root / "tiny-phi3", "phi3")
    _ASSETS.update({
        "root": root,
        "internlm2": save_tiny_internvl(internlm2, root / "tiny-internvl2-internlm2"),
        "phi3": save_tiny_internvl(phi3, root / "tiny-internvl2-phi3"),
        "data": write_llava_data(root / "data", n_images=8, n_text=8),
        INTERNLM2_LORA: copy_stock(INTERNLM2_LORA, root),
        PHI3_FULL: copy_stock(PHI3_FULL, root),
    })  # fmt: skip
    return _ASSETS


CAPTURE_IMPORT = "from xtuner_rope.capture.internvl import InternVLIsolationCaptureHook\n"


def with_internvl_capture(text: str) -> str:
    """Add ``InternVLIsolationCaptureHook`` to ``custom_hooks``: iteration 1 is saved."""
    text = sub_once(
        text, r"^(custom_hooks = \[)$", r"\g<1>\n    dict(type=InternVLIsolationCaptureHook),"
    )
    return sub_once(text, r"^(from xtuner.utils import .*\n)", r"\g<1>" + CAPTURE_IMPORT)


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
        r"\g<1>from xtuner_rope import internvl_collate_fn\n",
    )
