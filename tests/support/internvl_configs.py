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

from tools.zoo import internvl as zoo_internvl

INTERNLM2_LORA = "internvl_v2_internlm2_2b_lora_finetune"
PHI3_FULL = "internvl_v2_phi3_4b_finetune"


def localize_internvl(
    config: Path, model: Path, data_json: Path, batch_size: int = 4, cpu: bool = True
) -> str:
    """The user's own-machine edits of a stock InternVL config (the zoo's,
    :func:`tools.zoo.internvl.localize_internvl`), and on CPU the README's optimizer
    swap; returns the new text."""
    text = zoo_internvl.localize_internvl(
        config.read_text(encoding="utf-8"), model, data_json, batch_size
    )
    return cpu_optim_wrapper(text) if cpu else text


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


# The zoo's capture and packing edits, the same for the tests' runs.
with_internvl_capture = zoo_internvl.with_internvl_capture
with_internvl_collate = zoo_internvl.with_internvl_collate
