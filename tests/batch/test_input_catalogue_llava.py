"""Catalogue of bad and extreme LLaVA inputs: named before the first step, or trained right.

The text-SFT catalogue is ``test_input_catalogue.py``; this is its LLaVA counterpart. Each row
of ``BAD`` is (what a run calls, the bad input, the message naming the samples and the fix).
``EXTREME`` images (grayscale, RGBA, palette, huge) and text-only data must give what their
plain RGB equivalent gives, through XTuner's own ``LLaVADataset`` and the tiny CLIP's image
processor. The data checks (``data.llava_dataset_checks``) run in ``PackedBatchCheckHook.
before_train`` over the whole dataset; the real ``xtuner train`` refusal before the first step
is ``test_xtuner_train_refuses_bad_llava_data_before_the_first_step``.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from xtuner_rope.batch.images import IMAGE_TOKEN_INDEX, check_batch_with_images
from xtuner_rope.config.llava_tower import image_tokens_finding
from xtuner_rope.data.collate_llava import llava_collate_fn
from xtuner_rope.data.llava_dataset_checks import check_llava_dataset, llava_data_problems

REPO = Path(__file__).resolve().parents[2]
P = 16  # the tiny CLIP: (56 // 14) ** 2
I = IMAGE_TOKEN_INDEX  # noqa: E741 - reads like the placeholder in the id lists
TOWER = {
    "image_tokens": P,
    "path": "clip",
    "model_type": "clip",
    "image_size": 56,
    "patch_size": 14,
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """Images: a good one, a text file named .png, and a 50x50 one for the bomb limit."""
    root = tmp_path_factory.mktemp("llava_images")
    Image.new("RGB", (64, 48), (200, 30, 30)).save(root / "ok.png")
    (root / "notes.png").write_text("not an image")
    Image.new("RGB", (50, 50)).save(root / "big.png")
    return root


def problems(ids, names, folder, **kw):
    return "\n".join(llava_data_problems(ids, names, str(folder), P, **kw))


def one_item(ids, labels=None, image=True):
    labels = list(ids) if labels is None else labels
    return {
        "input_ids": ids,
        "labels": labels,
        "pixel_values": torch.ones(3, 56, 56) if image else torch.zeros(3, 56, 56),
    }


# llava_data_problems (what the run's before_train and the doctor report): (call, regex).
BAD_DATA = {
    "image file missing": (
        lambda f: problems([[1, I, 2]], ["gone.png"], f),
        r"train_dataloader.dataset.image_folder: 1 of 1 samples name an image that is not "
        r"there \(first: 0\).*Point image_folder at the images of data_path",
    ),
    "image file unreadable": (
        lambda f: problems([[1, I, 2], [1, I, 2]], ["ok.png", "notes.png"], f),
        r"1 samples name an image that cannot be opened \(first: 1 \(notes.png: "
        r"UnidentifiedImageError.*Replace the files or remove the samples",
    ),
    "image named, no <image> (placeholder cut by max_length, or never written)": (
        lambda f: problems([[1, I, 2], [1, 2, 3]], ["ok.png", "ok.png"], f),
        r"samples whose <image> does not match their image \(first: 1 \(ok.png, 0 <image>\)\)"
        r".*ignores an image without <image>.*needs a larger max_length",
    ),
    "<image> without an image": (
        lambda f: problems([[1, 2], [1, I, 2]], [None, None], f),
        r"\(first: 1 \(no image, 1 <image>\)\).*expands a zero \(black\) image",
    ),
    "two <image> in a sample": (
        lambda f: problems([[I, 1, I, 2]], ["ok.png"], f),
        r"samples with more than one <image> placeholder \(first: 0\).*Keep one <image>",
    ),
    "image sample longer than any llava_collate_fn row": (
        lambda f: problems([[1, I, 2, 3], list(range(1, 9))], ["ok.png", None], f, row_capacity=18),
        r"train_dataloader.collate_fn.max_length=18: 1 samples are longer than a row once each "
        r"image is 16 patch embeddings \(first: 0 \(19 tokens\)\).*19 tokens at most here",
    ),
    "image tokens past the LLM's RoPE range": (
        lambda f: problems([[1, I, 2]], ["ok.png"], f, max_position=17),
        r"max_length: 1 samples are longer than the LLM's RoPE range \(17 positions\)",
    ),
}
# What a run calls with a bad input, and the ValueError it must raise: (call, regex).
BAD_CALLS = {
    "llava_collate_fn: sample over max_length once expanded": (
        lambda: llava_collate_fn([one_item([1, I, 2, 3])], max_length=18, image_tokens=P),
        r"sample 0: 19 tokens after its image placeholder became 16 patch embeddings, over "
        r"max_length=18",
    ),
    "llava_collate_fn: image_tokens 0": (
        lambda: llava_collate_fn([one_item([1, I, 2])], max_length=64, image_tokens=0),
        r"option image_tokens: expected an int >= 1, got 0",
    ),
    "llava_collate_fn: two placeholders in a sample": (
        lambda: llava_collate_fn([one_item([I, 1, I, 2])], max_length=64, image_tokens=P),
        r"sample 0, field 'input_ids': expected at most one image placeholder",
    ),
    "llava_collate_fn: no supervised label in the batch": (
        lambda: llava_collate_fn(
            [one_item([1, I, 2], [-100, -100, -100])], max_length=64, image_tokens=P
        ),
        r"all 1 samples of the batch have no supervised label",
    ),
}
BAD_START_UP = {  # refused by the start-up (tests/config/test_llava_image_tokens.py: the run)
    "image_tokens smaller than the tower's": (4, r"4, but the vision tower .* gives 16 .*silently"),
    "image_tokens larger than the tower's": (64, r"64, but .*refused as over max_length"),
}


@pytest.mark.parametrize("case", list(BAD_DATA), ids=list(BAD_DATA))
def test_bad_llava_data_is_named_with_its_fix(case, folder):
    call, match = BAD_DATA[case]
    text = call(folder)
    assert re.search(match, text), text


@pytest.mark.parametrize("case", list(BAD_CALLS), ids=list(BAD_CALLS))
def test_bad_llava_call_raises(case):
    call, match = BAD_CALLS[case]
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("case", list(BAD_START_UP), ids=list(BAD_START_UP))
def test_wrong_image_tokens_is_a_start_up_conflict(case):
    asked, match = BAD_START_UP[case]
    finding = image_tokens_finding(asked, TOWER)
    assert finding.fix is None and finding.edit == "set image_tokens=16"
    assert re.search(match, finding.problem), finding.problem


def test_decompression_bomb_is_named_before_loading(folder, monkeypatch):
    """PIL refuses images over twice MAX_IMAGE_PIXELS when LLaVADataset opens them."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # 50x50 = 2500 > 2 * 1000
    text = problems([[1, I, 2]], ["big.png"], folder)
    assert "(first: 0 (big.png: DecompressionBombError" in text, text
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 2000)  # 2500 <= 2 * 2000: PIL only warns
    assert problems([[1, I, 2]], ["big.png"], folder) == ""


def _image(mode: str, size=(64, 48)) -> Image.Image:
    """A picture with structure (a gradient and a square), in ``mode``."""
    base = Image.linear_gradient("L").resize(size).convert("RGB")
    base.paste((30, 200, 60), (8, 8, 24, 24))
    if mode == "L":
        return base.convert("L")
    if mode == "P":
        return base.convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    return base.convert(mode)


# name -> (the image as written, the plain RGB file it must equal)
EXTREME_IMAGES = {
    "gray.png": (lambda: _image("L"), lambda: _image("L").convert("RGB")),
    "rgba.png": (lambda: _image("RGBA"), lambda: _image("RGB")),
    "palette.png": (lambda: _image("P"), lambda: _image("P").convert("RGB")),
    "huge.png": (lambda: _image("RGB", (3000, 2000)), None),
}


@pytest.fixture(scope="module")
def llava_dataset(tmp_path_factory):
    """XTuner's real ``LLaVADataset`` (tiny InternLM2 tokenizer, tiny CLIP processor) over the
    extreme images, their RGB twins and a text-only dialogue (tokenized in one process)."""
    from datasets import Dataset, DatasetDict
    from stock_configs import ensure_tiny_model
    from transformers import AutoTokenizer, CLIPImageProcessor
    from xtuner.dataset import LLaVADataset
    from xtuner.dataset.huggingface import process_hf_dataset
    from xtuner.dataset.map_fns import llava_map_fn, template_map_fn_factory
    from xtuner.utils import PROMPT_TEMPLATE

    from xtuner_rope.demo.tiny_clip import save_tiny_clip

    root = tmp_path_factory.mktemp("llava_extreme")
    (root / "images").mkdir()
    names = []
    for name, (make, twin) in EXTREME_IMAGES.items():
        make().save(root / "images" / name)
        names.append(name)
        if twin is not None:
            twin().save(root / "images" / f"rgb_{name}")
            names.append(f"rgb_{name}")
    turn = [{"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": "A box."}]
    rows = [{"id": n, "image": n, "conversations": turn} for n in names]
    text_turn = [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello."}]
    rows.append({"id": "text", "image": None, "conversations": text_turn})
    text = process_hf_dataset(
        dataset=DatasetDict({"train": Dataset.from_list(rows)}),
        tokenizer=AutoTokenizer.from_pretrained(str(ensure_tiny_model()), trust_remote_code=True),
        max_length=256,
        dataset_map_fn=llava_map_fn,
        template_map_fn=dict(type=template_map_fn_factory, template=PROMPT_TEMPLATE.internlm2_chat),
        split="train",
        remove_unused_columns=False,
        pack_to_max_length=False,
        with_image_token=True,
        map_num_proc=1,
    )
    text.save_to_disk(str(root / "text"))
    processor = CLIPImageProcessor.from_pretrained(str(save_tiny_clip(root / "clip")))
    dataset = LLaVADataset(
        image_folder=str(root / "images"),
        image_processor=processor,
        offline_processed_text_folder=str(root / "text"),
        pad_image_to_square=True,  # as XTuner's stock LLaVA configs
    )
    return dataset, {row["id"]: i for i, row in enumerate(dataset.text_data)}


@pytest.mark.parametrize("name", [n for n, (_, twin) in EXTREME_IMAGES.items() if twin])
def test_grayscale_rgba_palette_images_give_their_rgb_pixels(llava_dataset, name):
    dataset, index = llava_dataset
    got = dataset[index[name]]["pixel_values"]
    want = dataset[index[f"rgb_{name}"]]["pixel_values"]
    assert got.shape == (3, 56, 56)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_huge_image_is_resized_and_the_whole_dataset_passes_the_checks(llava_dataset):
    dataset, index = llava_dataset
    pixels = dataset[index["huge.png"]]["pixel_values"]
    assert pixels.shape == (3, 56, 56) and bool(torch.isfinite(pixels).all())
    check_llava_dataset(dataset, P, row_capacity=256, max_position=256)  # nothing refused


def test_text_only_batches_only_collate_to_one_ignored_image_per_row(llava_dataset):
    """A batch of text-only samples: one zero image per row, which XTuner's expansion takes
    and ignores (each sample then equals itself alone: tests/data/test_llava_packing.py)."""
    dataset, index = llava_dataset
    items = [dataset[index["text"]]] * 3
    data = llava_collate_fn(items, max_length=64, image_tokens=P, return_hf_format=True)
    rows = data["input_ids"].shape[0]
    assert int((data["input_ids"] == I).sum()) == 0 and data["pixel_values"].shape[0] == rows
    assert bool((data["pixel_values"] == 0).all())
    check_batch_with_images(data, vocab_size=1024, max_position=256)


@pytest.mark.slow
def test_xtuner_train_refuses_bad_llava_data_before_the_first_step(tmp_path):
    """The tiny LLaVA recipe on data with a missing image and an image sample whose <image>
    was left out, through the real ``xtuner train`` code (``python -m xtuner.tools.train``,
    which returns 1): ``PackedBatchCheckHook.before_train`` names both before iteration 1."""
    import llava_configs as lc

    from xtuner_rope.demo.llava_data import write_llava_data

    data = write_llava_data(tmp_path / "data", n_images=6, n_text=6)
    rows = json.loads(data.read_text())
    with_image = [i for i, r in enumerate(rows) if r.get("image")]
    missing, unmatched = with_image[1:3]  # the first image is the evaluation image
    (data.parent / "images" / rows[missing]["image"]).unlink()
    turn = rows[unmatched]["conversations"][0]
    turn["value"] = turn["value"].replace("<image>", "").strip()
    data.write_text(json.dumps(rows))
    text = (REPO / "configs" / "tiny_llava_internlm2_short_dialogues.py").read_text()
    for rel in ("models/tiny-internlm2", "models/tiny-clip"):
        text = text.replace(f'"{rel}', f'"{REPO}/{rel}')
    text = text.replace('"data/tiny_llava', f'"{data.parent}')
    config = tmp_path / "bad_data.py"
    config.write_text(text)
    config.write_text(lc.with_offline_text(text, lc.save_offline_text(config, tmp_path / "text")))
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "xtuner.tools.train",
            str(config),
            "--work-dir",
            str(tmp_path / "w"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 1, out[-3000:]
    assert "the LLaVA training data would fail or train silently wrong (12 samples" in out
    assert f"1 of 6 samples name an image that is not there (first: {missing})" in out
    assert f"(first: {unmatched} ({rows[unmatched]['image']}, 0 <image>))" in out
    assert "Iter(train)" not in out, out[-3000:]
