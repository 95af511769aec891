"""The classes of the config zoo (``tools.zoo.classes``), read from the 594 config texts.

Each config has one value on every axis (the data axes: every builder and map function it
combines); the classes table says which swept rows cover each class, and a row covers only
with an outcome that shows what the plugin does there.
"""

import pytest
import stock_configs as sc

from tools import zoo


@pytest.fixture(scope="module")
def texts() -> dict[str, str]:
    return zoo.stock_texts()


def test_every_listed_file_has_a_kind(texts):
    kinds = {}
    for name, text in texts.items():
        kinds.setdefault(zoo.kind_of(text, name), []).append(name)
    assert len(texts) == 594
    assert {k: len(v) for k, v in kinds.items()} == {
        "sft": 508,
        "llava": 33,
        "internvl": 21,
        "dpo": 8,
        "reward": 7,
        "orpo": 5,
        "deepspeed_json": 5,
        "script": 4,
        "hf_trainer": 3,
    }


@pytest.mark.parametrize(
    "name, expected",
    [
        (
            "internlm2_chat_1_8b_qlora_alpaca_e3",
            {
                "kind": "sft",
                "family": "sft/internlm2",
                "packing": "sft/packed",
                "tuning": "sft/qlora",
                "builder": ["process_hf_dataset"],
                "data": ["alpaca_map_fn"],
                "launch": "one process, default sampler",
                "model settings": "none",
            },
        ),
        (
            "mistral_7b_w_untokenized_dataset",
            {
                "kind": "sft",
                "family": "sft/mistral",
                "packing": "sft/varlen",
                "tuning": "sft/full",
                "builder": ["build_packed_dataset", "load_intern_repo_untokenized_dataset"],
                "data": ["no map function"],
                "launch": "InternRepoSampler (DeepSpeed data-parallel group)",
                "model settings": "flash_attention_2, weights bfloat16",
            },
        ),
        (
            "llama3_8b_instruct_dpo_qlora_varlenattn",
            {
                "kind": "dpo",
                "family": "dpo/llama",
                "packing": "dpo/varlen",
                "tuning": "dpo/qlora",
                "builder": ["build_preference_dataset"],
                "data": ["orpo_dpo_mix_40k_map_fn"],
                "launch": "one process, default sampler",
                "model settings": "none",
            },
        ),
        ("deepspeed_zero2", {"kind": "deepspeed_json"}),
    ],
)
def test_a_config_is_classified_from_its_text(texts, name, expected):
    assert zoo.classify(name, texts[name]) == expected


def test_the_classes_table_counts_configs_classes_and_uncovered(texts):
    classes = zoo.zoo_classes(texts)
    assert sum(len(v) for (axis, _), v in classes.items() if axis == "kind") == 594
    packed = "internlm2_chat_1_8b_qlora_alpaca_e3"
    rows = {packed: {"outcome": zoo.TRAINED, "mode": zoo.mode_of(texts[packed], packed)}}
    table, uncovered = zoo.classes_markdown(texts, rows)
    assert f"| kind | sft | 508 | {packed} | trained isolated |" in table
    assert table.splitlines()[-1] == (
        f"594 configs (1 swept), {len(classes)} classes, {len(uncovered)} uncovered."
    )
    assert "kind: sft" not in uncovered and "kind: dpo" in uncovered


def test_a_packed_row_of_one_document_covers_nothing(texts):
    """'Not exercised' covers a class only where the config does not pack (one document a row
    is all it does); a packed config's one-document batch shows nothing about isolation."""
    packed, unpacked = "internlm2_chat_1_8b_qlora_alpaca_e3", "llama2_7b_qlora_oasst1_512_e3"
    assert zoo.mode_of(texts[unpacked], unpacked)["packing"] == "unpacked"
    for name, covers in ((packed, False), (unpacked, True)):
        row = {"outcome": zoo.NOT_EXERCISED, "mode": zoo.mode_of(texts[name], name)}
        (result,) = [r for r in zoo.coverage({("x", "y"): [name]}, {name: row})]
        assert bool(result[3]) is covers
    crashed = {"outcome": zoo.CRASHED, "mode": {}}
    assert zoo.coverage({("x", "y"): [packed]}, {packed: crashed})[0][3] == []


def test_the_docs_state_the_sweeps_figures(texts):
    """The zoo's figures in the docs are the ones its results give (a re-sweep that is not
    written back to the docs fails here)."""
    docs = sc.REPO / "docs"
    results = zoo.load_results(docs / "zoo" / "results.json")
    assert (docs / "zoo" / "zoo.md").read_text() == zoo.markdown(results)
    table, _ = zoo.classes_markdown(texts, results)
    assert (docs / "zoo" / "classes.md").read_text() == table
    closing = table.splitlines()[-1]
    assert closing in (docs / "tools" / "zoo.md").read_text().replace("\n", " ")
