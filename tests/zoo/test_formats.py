"""The sweep's data for XTuner's own dataset classes and own-column map functions
(``tools.zoo.formats``, ``tools.zoo.refcoco``), read by XTuner's real classes.

- ``MOSSSFTDataset`` builds its samples from the sweep's MOSS files, and a second build reads
  the caches it wrote under torch's weights-only default (no patch needed: the caches hold
  lists of ints and tuples). The stock row's ``UnpicklingError`` came from the sweep giving it
  ``train.json``: XTuner names its cache by replacing ``.jsonl``, so the cache *is* the source
  (the negative control below reproduces it).
- ``RefCOCOJsonDataset`` / ``InvRefCOCOJsonDataset`` build conversations from the RefCOCO
  annotations (LLaVA's JSON: ``KeyError: 'sents'``), the box answer computed from the drawing.
- ``colors_map_fn`` / ``tiny_codes_map_fn`` read realistic columns that pack several to a row.
"""

import json
import pickle
import random

import pytest

from tools.zoo import formats, refcoco
from tools.zoo.classes import packing_of
from tools.zoo.data import write_universal_data
from xtuner_rope.capture.text import packs_documents


@pytest.fixture(scope="module")
def moss_files(tmp_path_factory):
    return formats.write_moss_data(tmp_path_factory.mktemp("moss"), n=12)


def _moss(path, tokenizer):
    from xtuner.dataset import MOSSSFTDataset

    return MOSSSFTDataset(str(path), tokenizer, max_length=512, bot_name="Llama")


def test_moss_dataset_builds_and_reloads_its_cache(moss_files, tiny_tokenizer):
    tools = moss_files[True]
    first = _moss(tools, tiny_tokenizer)
    caches = sorted(p.name for p in tools.parent.glob("moss-003-sft-with-tools_*"))
    assert len(caches) == 2  # data and no-loss spans, written by XTuner
    second = _moss(tools, tiny_tokenizer)  # torch.load of the caches, weights-only default
    assert len(first) == len(second) == 12
    assert [second[i]["input_ids"] for i in range(12)] == [first[i]["input_ids"] for i in range(12)]
    item = second[0]
    # The meta instruction and the tool's result are unsupervised; the rest is learned.
    supervised = sum(label != -100 for label in item["labels"])
    assert 0 < supervised < len(item["input_ids"])
    spans = second.no_loss_spans[0]  # the meta instruction, then each kept turn's tool result
    assert spans[0][0] == 0 and len(spans) >= 2


def test_moss_dataset_given_a_json_name_reads_its_source_as_the_cache(tmp_path, tiny_tokenizer):
    """Negative control: the stock row's crash (XTuner's cache name is the source's)."""
    json_name = tmp_path / "train.json"
    rows = formats.moss_rows(2, tools=False)
    json_name.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    with pytest.raises(pickle.UnpicklingError):
        _moss(json_name, tiny_tokenizer)


def test_moss_settings_point_at_both_files(moss_files):
    stock = (
        'moss_sft_no_plugins_path = "./data/moss-003-sft-no-tools.jsonl"\n'
        'moss_sft_plugins_path = "./data/conversations_with_tools_0709.jsonl"  # noqa: E501\n'
    )
    edited = formats.localize_moss(stock, moss_files)
    assert f'moss_sft_no_plugins_path = "{moss_files[False]}"' in edited
    assert f'moss_sft_plugins_path = "{moss_files[True]}"' in edited
    assert formats.localize_moss(stock, None) == stock


def test_moss_configs_are_unpacked():
    text = "train_dataset = dict(\n    type=ConcatDataset, datasets=[a, b])\n"
    text += "a = dict(\n    type=MOSSSFTDataset,\n)\n"
    assert packing_of(text, "sft") == "unpacked"
    assert packing_of(text.replace("MOSSSFTDataset", "Other"), "sft") == "packed"
    moss = {"type": "MOSSSFTDataset"}
    assert not packs_documents({"type": "xtuner.dataset.ConcatDataset", "datasets": [moss]})
    assert packs_documents({"type": "process_hf_dataset"})
    assert not packs_documents({"type": "process_hf_dataset", "pack_to_max_length": False})


def test_refcoco_dataset_builds_from_the_annotations(tmp_path, tiny_tokenizer):
    """One real build (XTuner maps it with up to 32 processes: one picture keeps it short);
    the inverse dataset's conversation from the same entry."""
    from transformers import CLIPImageProcessor
    from xtuner.dataset.map_fns import llava_map_fn, template_map_fn_factory
    from xtuner.dataset.refcoco_json import InvRefCOCOJsonDataset, RefCOCOJsonDataset
    from xtuner.utils import IMAGE_TOKEN_INDEX, PROMPT_TEMPLATE

    images = tmp_path / "images"
    path = refcoco.write_refcoco_data(tmp_path, images, n_images=1)
    entries = json.loads(path.read_text())
    cls = RefCOCOJsonDataset
    dataset = cls(
        data_path=str(path),
        image_folder=str(images),
        tokenizer=tiny_tokenizer,
        image_processor=CLIPImageProcessor(size={"shortest_edge": 32}, crop_size=32),
        dataset_map_fn=llava_map_fn,
        template_map_fn=dict(type=template_map_fn_factory, template=PROMPT_TEMPLATE.vicuna),
        max_length=256,
        pad_image_to_square=True,
    )
    assert len(dataset) == 2 * len(cls.instruction_pool)  # 1 picture, 2 shapes
    item = dataset[0]
    assert IMAGE_TOKEN_INDEX in item["input_ids"]
    assert tuple(item["pixel_values"].shape) == (3, 32, 32)
    # The box in hundredths of the picture, as XTuner asks it (answer or question).
    first = entries[0]
    box = cls.normalize_bbox(first["bbox"], first["height"], first["width"])
    text = tiny_tokenizer.decode([t for t in item["input_ids"] if t >= 0])
    assert "".join(f"<{v}>" for v in box).replace(" ", "") in text.replace(" ", "")
    question, answer = InvRefCOCOJsonDataset.gen_refcoco_conversations(first, "[identify] {}")
    assert first["sents"] == answer["value"] and question["value"].count("<") >= 4


def test_refcoco_datasets_fail_on_llava_json(tmp_path, tiny_tokenizer):
    """Negative control: what the sweep gave them before (LLaVA conversations)."""
    from xtuner.dataset.refcoco_json import RefCOCOJsonDataset

    llava = [{"id": "0", "image": "a.png", "conversations": []}]
    (tmp_path / "llava.json").write_text(json.dumps(llava))
    with pytest.raises(KeyError, match="sents"):
        RefCOCOJsonDataset(str(tmp_path / "llava.json"), str(tmp_path), tiny_tokenizer, None)


def test_refcoco_boxes_hold_the_drawn_shape(tmp_path):
    from PIL import Image

    entries = refcoco.refcoco_entries(3, tmp_path)
    for entry in entries:
        x, y, w, h = entry["bbox"]
        image = Image.open(tmp_path / entry["image"]).convert("RGB")
        centre = image.getpixel((x + w // 2, y + h * 3 // 4))  # inside circle, square, triangle
        colour = entry["sents"].split()[1]
        assert centre == refcoco.COLOURS[colour], entry


def test_colour_and_code_columns_pack_several_to_a_row(tmp_path, tiny_tokenizer):
    from datasets import load_dataset
    from xtuner.dataset import process_hf_dataset
    from xtuner.dataset.map_fns import (
        colors_map_fn,
        template_map_fn_factory,
        tiny_codes_map_fn,
    )
    from xtuner.utils import PROMPT_TEMPLATE

    data = write_universal_data(tmp_path / "d", n=60)
    rows = json.loads((data / "train.json").read_text())
    for row in rows:
        name, looks = row["description"].split(": ", 1)
        assert looks and row["color"].startswith("#") and len(row["color"]) == 7
        assert "```python\ndef " in row["response"] and row["prompt"].startswith("Write a Python")
    for map_fn in (colors_map_fn, tiny_codes_map_fn):
        packed = process_hf_dataset(
            dataset=load_dataset("json", data_files=[str(data / "train.json")]),
            tokenizer=tiny_tokenizer,
            max_length=512,
            dataset_map_fn=map_fn,
            template_map_fn=dict(type=template_map_fn_factory, template=PROMPT_TEMPLATE.default),
            pack_to_max_length=True,
            use_varlen_attn=True,
            shuffle_before_pack=False,
            map_num_proc=1,
        )
        per_row = [len(p["cumulative_len"]) - 1 for p in packed]
        assert min(per_row) >= 2, (map_fn.__name__, per_row)


def test_colour_names_agree_with_their_codes():
    rng = random.Random(1)
    for _ in range(50):
        row = formats.colour_columns(rng)
        name = row["description"].split(":")[0].lower()
        rgb = [int(row["color"][i : i + 2], 16) for i in (1, 3, 5)]
        base = formats.BASE_COLOURS[name.split()[1]]
        light = sum(rgb) > sum(base)
        assert light == (name.split()[0] in ("pale", "light", "bright")), row


def test_moss_and_refcoco_configs_are_pointed_at_their_own_files():
    """Every stock MOSS and RefCOCO config: its settings name the sweep's own files (not the
    dialogues' ``train.json`` or LLaVA's JSON), and no stock path survives."""
    from pathlib import Path

    from tools import zoo

    moss = {False: Path("/local/moss/plain.jsonl"), True: Path("/local/moss/tools.jsonl")}
    files = zoo.LocalFiles(
        model=Path("/local/model"),
        data=Path("/local/data"),
        pairs=Path("/local/pairs.jsonl"),
        clip=Path("/local/clip"),
        llava_json=Path("/local/llava/llava_data.json"),
        moss=moss,
        refcoco=Path("/local/llava/refcoco_train.json"),
    )
    texts = {
        n: t
        for n, t in zoo.stock_texts().items()
        if "type=MOSSSFTDataset" in t or "type=RefCOCOJsonDataset" in t
    }
    assert len(texts) == 18 + 1
    for name, text in texts.items():
        edited = zoo.localized(text, zoo.kind_of(text, name), files)
        assert zoo.surviving_paths(text, edited) == [], name
        if "type=RefCOCOJsonDataset" in text:
            assert 'refcoco_path = "/local/llava/refcoco_train.json"' in edited
            continue
        for setting, tools in (("no_plugins", False), ("plugins", True)):
            if f"moss_sft_{setting}_path = " in text:
                assert f'moss_sft_{setting}_path = "{moss[tools]}"' in edited, name
