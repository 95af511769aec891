"""XTuner's stock LLaVA configs as a user gets them (``xtuner copy-cfg``), pointed at local files.

The edits any user makes to run a stock LLaVA config on their own machine: the LLM and CLIP
paths, the data, no pretrain-stage projector (``pretrained_pth = None``: we have none), a
short ``max_length``, a learning rate for a tiny model, one optimizer step per iteration, a
local evaluation image, and on a CPU-only machine fp32 ``OptimWrapper`` instead of
``AmpOptimWrapper``. ``enable_plugin_llava`` makes the README's one edit after
``llm_name_or_path``. Each edit must match exactly once (``stock_configs.sub_once``).
"""

from __future__ import annotations

from pathlib import Path

from stock_configs import PLUGIN_EDIT, cpu_optim_wrapper, sub_once

FINETUNE = "llava_internlm2_chat_7b_clip_vit_large_p14_336_e1_gpu8_finetune"
PRETRAIN = "llava_internlm2_chat_1_8b_clip_vit_large_p14_336_e1_gpu8_pretrain"


def localize_llava(
    config: Path, llm: Path, clip: Path, data_json: Path, batch_size: int = 4, cpu: bool = True
) -> str:
    """The user's own-machine edits of a stock LLaVA config; returns the new text."""
    text = config.read_text(encoding="utf-8")
    text = sub_once(text, r'^llm_name_or_path = ".*"$', f'llm_name_or_path = "{llm}"')
    text = sub_once(
        text, r'^visual_encoder_name_or_path = ".*"$', f'visual_encoder_name_or_path = "{clip}"'
    )
    if "pretrained_pth = " in text:
        text = sub_once(text, r'^pretrained_pth = ".*"(  # noqa: E501)?$', "pretrained_pth = None")
    text = sub_once(text, r"^data_path = .*$", f'data_path = "{data_json}"')
    text = sub_once(text, r"^image_folder = .*$", f'image_folder = "{data_json.parent / "images"}"')
    text = sub_once(text, r"^max_length = .*$", "max_length = 256")
    text = sub_once(text, r"^batch_size = \d+", f"batch_size = {batch_size}")
    text = sub_once(text, r"^dataloader_num_workers = \d+", "dataloader_num_workers = 0")
    text = sub_once(text, r"^lr = .*$", "lr = 1e-3")
    text = sub_once(text, r"^accumulative_counts = \d+", "accumulative_counts = 1")
    text = sub_once(text, r"^warmup_ratio = .*$", "warmup_ratio = 0.3")  # >= 1 of few iterations
    first_image = sorted((data_json.parent / "images").iterdir())[0]
    text = sub_once(text, r'^evaluation_images = ".*"$', f'evaluation_images = "{first_image}"')
    text = sub_once(text, r"^evaluation_inputs = .*$", 'evaluation_inputs = ["What is this?"]')
    text = (
        sub_once(text, r"^(        quantization_config=dict\((\n.*?)*?\n        \),\n)", "")
        if "quantization_config=" in text
        else text
    )
    if cpu:
        text = cpu_optim_wrapper(text)
    return text


def enable_plugin_llava(text: str, with_pretrained_alias: bool = False) -> str:
    """The README's one edit after ``llm_name_or_path`` (optionally the user's alias line too)."""
    alias = "pretrained_model_name_or_path = llm_name_or_path\n" if with_pretrained_alias else ""
    return sub_once(text, r'^(llm_name_or_path = ".*"\n)', r"\g<1>" + alias + PLUGIN_EDIT)


def llava_assets(root: Path) -> dict:
    """Tiny InternLM2 (hub-style remote code), tiny CLIP, drawn images + short text dialogues
    (12 + 12) and the two stock configs copied with ``xtuner copy-cfg``, under ``root``."""
    from stock_configs import copy_stock, ensure_tiny_model, tiny_with_remote_code

    from xtuner_rope.demo.llava_data import write_llava_data
    from xtuner_rope.demo.tiny_clip import save_tiny_clip

    ensure_tiny_model()
    return {
        "root": root,
        "llm": tiny_with_remote_code(root / "tiny-internlm2-remote"),
        "clip": save_tiny_clip(root / "tiny-clip"),
        "data": write_llava_data(root / "data", n_images=12, n_text=12),
        "finetune": copy_stock(FINETUNE, root),
        "pretrain": copy_stock(PRETRAIN, root),
    }


def with_llava_collate(text: str, max_length: int = 256, image_tokens: int = 16) -> str:
    """Pack the config's samples at collate time: ``llava_collate_fn`` instead of XTuner's
    ``default_collate_fn`` (the README's packing edit for LLaVA)."""
    text = sub_once(
        text,
        r"collate_fn=dict\(type=default_collate_fn\)",
        f"collate_fn=dict(type=llava_collate_fn, max_length={max_length}, "
        f"image_tokens={image_tokens})",
    )
    return sub_once(
        text,
        r"^(from xtuner.dataset.collate_fns import default_collate_fn\n)",
        r"\g<1>from xtuner_rope import llava_collate_fn\n",
    )


def llava_text(config: Path, max_length: int | None = None):
    """The config's ``LLaVADataset`` text through XTuner's own tokenize call (``LLaVADataset``'s
    arguments, one map process instead of its default 32), cut at ``max_length`` (default:
    the config's)."""
    import json

    from datasets import Dataset, DatasetDict
    from mmengine.config import Config
    from xtuner.dataset.huggingface import process_hf_dataset

    ds = Config.fromfile(str(config)).train_dataloader.dataset
    rows = json.loads(Path(ds.data_path).read_text(encoding="utf-8"))
    return process_hf_dataset(
        dataset=DatasetDict({"train": Dataset.from_list(rows)}),
        tokenizer=ds.tokenizer,
        max_length=ds.max_length if max_length is None else max_length,
        dataset_map_fn=ds.dataset_map_fn,
        template_map_fn=ds.template_map_fn,
        split="train",
        remove_unused_columns=False,
        pack_to_max_length=False,
        with_image_token=True,
        map_num_proc=1,
    )


def save_offline_text(config: Path, out_dir: Path) -> Path:
    """The config's ``LLaVADataset`` text, tokenized once and saved where XTuner's
    ``offline_processed_text_folder`` loads it (what ``xtuner process_untokenized_llava_data``
    does for a large set; here it spares each test XTuner's 32-process tokenization)."""
    llava_text(config).save_to_disk(str(out_dir))
    return out_dir


def with_offline_text(text: str, folder: Path) -> str:
    """Load the tokenized text from ``folder`` (``offline_processed_text_folder``)."""
    return sub_once(
        text,
        r"^(llava_dataset = dict\(\n)",
        rf'\g<1>    offline_processed_text_folder="{folder}",\n',
    )
