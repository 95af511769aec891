"""The zoo's localizer (``tools.zoo.localize``) over the text of every stock config.

No hub id or cluster path of a stock config survives the edits of its kind: every model, data
and folder path setting points at local files (the known miss was
``mistral_7b_w_untokenized_dataset``: a model path line ending in ``# noqa: E501`` and its
``dataset_folder``). A checkpoint id is kept only on purpose (no tiny builder for the family)
and only when the caller says so. Reads the installed XTuner's config files; runs nothing.
"""

from pathlib import Path

import pytest

from tools import zoo

FILES = zoo.LocalFiles(
    model=Path("/local/model"),
    data=Path("/local/data"),
    pairs=Path("/local/pairs.jsonl"),
    clip=Path("/local/clip"),
    llava_json=Path("/local/llava/llava_data.json"),
)


@pytest.fixture(scope="module")
def edited() -> dict[str, tuple[str, str]]:
    """``{config: (stock text, localized text)}`` of every training config of ``list-cfg``."""
    out = {}
    for name, text in zoo.stock_texts().items():
        kind = zoo.kind_of(text, name)
        if kind not in ("deepspeed_json", "script"):
            out[name] = (text, zoo.localized(text, kind, FILES))
    return out


def test_every_training_config_is_localized_completely(edited):
    assert len(edited) == 594 - 5 - 4  # less the DeepSpeed jsons and conversion scripts
    left = {n: zoo.surviving_paths(s, e) for n, (s, e) in edited.items()}
    assert {n: p for n, p in left.items() if p} == {}
    for name, (_, text) in edited.items():
        compile(text, name, "exec")  # still a config MMEngine can read


def test_the_check_sees_what_an_unedited_config_points_at(edited):
    """The negative control: the stock text itself keeps all its paths, the known miss too."""
    stock, text = edited["mistral_7b_w_untokenized_dataset"]
    assert zoo.surviving_paths(stock, stock) == [
        "/mnt/petrelfs/share_data/basemodel/checkpoints/llm/hf_hub/models--mistralai--"
        "Mistral-7B-v0.1/snapshots/5e9c98b96d071dce59368012254c55b0ec6f8658",
        "/mnt/petrelfs/share_data/caoweihan/v1_sample_with_legal_cate",
    ]
    assert 'pretrained_model_name_or_path = "/local/model"' in text
    assert 'dataset_folder = "/local/data"' in text
    unchecked = sum(1 for s, _ in edited.values() if zoo.surviving_paths(s, s))
    assert unchecked == len(edited)  # every config names at least one path to replace


def test_a_checkpoint_id_is_kept_only_on_purpose():
    """Without a tiny builder the hub id stays (the row then shows what happens offline); it
    counts as left behind unless the caller names it as kept."""
    stock = zoo.stock_texts(["qwen_7b_qlora_sql_e3"])["qwen_7b_qlora_sql_e3"]
    text = zoo.localize(stock, None, FILES.data)
    assert zoo.surviving_paths(stock, text) == ["Qwen/Qwen-7B"]
    assert zoo.surviving_paths(stock, text, kept=("Qwen/Qwen-7B",)) == []


def test_suffixes_follow_their_root_and_keep_its_slash():
    text = 'data_root = "./data/llava_data/"\ndata_path = data_root + "x/train.json"\n'
    out = zoo.localize(text, None, Path("/local/data"))
    assert 'data_root = "/local/data/"' in out
    assert zoo.path_literals(text) == ("./data/llava_data/",)  # the suffix follows data_root


def test_internvl_rows_get_a_tiny_internvl_packed_and_captured(edited):
    """Every stock InternVL config (``model.type=InternVL_V1_5``): the tiny checkpoint after
    ``path =`` with the one edit, the LLaVA-format data, no 4-bit on CPU, fp32
    ``OptimWrapper``, the plugin's packing collate and the InternVL capture hook."""
    from tools.zoo.internvl import internvl_llm_of

    names = sorted(n for n in edited if n.startswith("internvl_"))
    assert len(names) == 21
    assert {n: internvl_llm_of(n) for n in names if internvl_llm_of(n) is None} == {}
    assert internvl_llm_of("internvl_v2_internlm2_5_8b_finetune") == "internlm2"
    assert internvl_llm_of("internvl_v1_5_phi3_4b_qlora_finetune") == "phi3"
    for name in names:
        stock, text = edited[name]
        assert 'path = "/local/model"\nfrom xtuner_rope import enable_xtuner_rope\n' in text
        assert 'data_path = "/local/llava/llava_data.json"' in text
        assert 'image_folder = "/local/llava/images"' in text
        assert "collate_fn=dict(type=internvl_collate_fn, max_length=512)" in text
        assert "dict(type=InternVLIsolationCaptureHook)," in text
        assert "AmpOptimWrapper" not in text and "quantization_llm=True" not in text
        assert ("quantization_llm=True" in stock) == name.endswith("qlora_finetune")


def test_an_internvl_config_without_its_data_setting_is_named():
    from tools.zoo.internvl import localize_internvl

    stock = zoo.stock_texts(["internvl_v2_phi3_4b_finetune"])["internvl_v2_phi3_4b_finetune"]
    with pytest.raises(ValueError, match=r"data_path = .* matched 0 times"):
        localize_internvl(
            stock.replace("\ndata_path = ", "\nannotations = "), None, FILES.llava_json
        )


def test_chat_samples_are_short_and_dataset_maps_use_one_process(edited):
    """The trial's cheap settings, on every config that has them: ``EvaluateChatHook`` writes
    samples of ``CHAT_SAMPLE_TOKENS`` new tokens (a ``max_new_tokens`` of the stock hook set,
    never doubled) and XTuner's dataset maps run in one process instead of 32."""
    import re

    hooked = packed = 0
    for name, (stock, text) in edited.items():
        for block in re.findall(r"type=EvaluateChatHook,\n((?:\s+\w+=.*\n)*)", text):
            assert re.findall(r"max_new_tokens=(.*),", block) == [str(zoo.CHAT_SAMPLE_TOKENS)], name
            hooked += 1
        calls = stock.count("type=process_hf_dataset,")
        assert text.count("map_num_proc=1,") >= calls, name
        packed += calls
    assert hooked > 400 and packed > 400, (hooked, packed)


def test_a_setting_is_set_once_in_every_dict_of_its_type():
    text = (
        "a = dict(\n    type=EvaluateChatHook,\n    template=dict(\n        x=1,\n    ),\n"
        "    max_new_tokens=600,\n)\nb = dict(\n    type=EvaluateChatHook,\n    system=S,\n)\n"
    )
    once = zoo.short_chat_samples(text, 4)
    assert once.count("max_new_tokens=4,") == 2 and "600" not in once
    assert zoo.short_chat_samples(once, 4) == once  # never written twice
    assert zoo.short_chat_samples("no hook here\n") == "no hook here\n"
    compile(once, "config", "exec")
