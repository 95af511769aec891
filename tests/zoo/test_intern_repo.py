"""The sweep's intern-repo data (``tools.zoo.intern_repo``) read by XTuner's own loaders.

The tokenized ``.bin`` + ``.bin.meta`` files go through the real
``load_intern_repo_tokenized_dataset``, the untokenized message lines through the real
``load_intern_repo_untokenized_dataset`` (XTuner's ``openai_map_fn``, its template, the tiny
tokenizer): both give each dialogue the same input ids and labels, and the real
``build_packed_dataset`` packs them into rows of several documents with their
``cumulative_len``. Every stock intern-repo config, localized, points its ``dataset_folder`` at
the folder written for it. Nothing trains here but the one slow run: a stock tokenized config
whose collate function drops the boundaries (``use_varlen_attn = False``, what a user without
flash-attn sets) trains isolated with the plugin's start-up fix (without it: 0.76 max logit
error, see docs/zoo); the doctor reads the offline packs as packed rows, none cut.
"""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import stock_configs as sc
from transformers import AutoTokenizer
from xtuner.dataset.intern_repo import (
    build_packed_dataset,
    load_intern_repo_tokenized_dataset,
    load_intern_repo_untokenized_dataset,
)
from xtuner.dataset.map_fns import template_map_fn_factory
from xtuner.utils import PROMPT_TEMPLATE

from tools import zoo
from tools.zoo import intern_repo as ir
from xtuner_rope.doctor.diagnose import diagnose
from xtuner_rope.doctor.report import format_summary

N = 12  # dialogues: the untokenized loader maps them with up to 32 processes, one per row
TEMPLATE = "internlm2_chat"
STOCK = {
    "internlm2_7b_w_tokenized_dataset": "tokenized",
    "internlm2_7b_w_internevo_dataset": "tokenized",
    "internlm_7b_full_intern_repo_dataset_template": "tokenized",
    "mistral_7b_w_tokenized_dataset": "tokenized",
    "internlm2_7b_w_untokenized_dataset": "untokenized",
    "mistral_7b_w_untokenized_dataset": "untokenized",
}


@pytest.fixture(scope="module")
def tiny() -> Path:
    return sc.ensure_tiny_model().resolve()


@pytest.fixture(scope="module")
def encoded(tiny) -> list[dict]:
    return ir.encoded_dialogues(tiny, TEMPLATE, N)


@pytest.fixture(scope="module")
def tokenized(tmp_path_factory, tiny) -> Path:
    folder = tmp_path_factory.mktemp("tokenized")
    ir.write_tokenized(folder, tiny, TEMPLATE, N)
    return folder


def test_tokenized_files_are_read_by_xtuners_loader(tokenized, encoded):
    (dataset,) = load_intern_repo_tokenized_dataset(str(tokenized), min_length=0)
    assert len(dataset) == N
    for i, doc in enumerate(encoded):
        item = dataset[i]
        assert item["input_ids"] == doc["input_ids"]
        assert item["labels"] == doc["labels"]  # the negated ids are the unsupervised ones
    assert any(lab == -100 for lab in encoded[0]["labels"])
    assert any(lab != -100 for lab in encoded[0]["labels"])


def test_untokenized_lines_give_xtuner_the_same_tokens(tmp_path, tiny, encoded):
    ir.write_untokenized(tmp_path, N)
    (dataset,) = load_intern_repo_untokenized_dataset(
        folder=str(tmp_path),
        tokenizer=AutoTokenizer.from_pretrained(str(tiny)),
        max_length=4096,
        template_map_fn=template_map_fn_factory(template=PROMPT_TEMPLATE[TEMPLATE]),
    )
    assert len(dataset) == N
    got = sorted((row["input_ids"], row["labels"]) for row in dataset)
    assert got == sorted((doc["input_ids"], doc["labels"]) for doc in encoded)


def test_build_packed_dataset_packs_several_documents_with_boundaries(tokenized, encoded):
    datasets = load_intern_repo_tokenized_dataset(str(tokenized), min_length=0)
    packed = build_packed_dataset(datasets, packed_length=256, seed=1024)
    assert len(packed) == sum(len(d["input_ids"]) for d in encoded) // 256 > 1
    row = packed[0]
    cu = row["cumulative_len"]
    assert len(row["input_ids"]) == cu[-1] == 256 and cu[0] == 0 and len(cu) > 2
    starts = [i for i, p in enumerate(row["position_ids"]) if p == 0]
    assert starts == cu[:-1]  # positions restart at every document (a cut one too)


def test_every_stock_intern_repo_config_points_at_its_own_data(tmp_path, tiny):
    texts = zoo.stock_texts()
    files = zoo.LocalFiles(tiny, tmp_path / "dialogues", tmp_path / "p.jsonl", tiny, tiny)
    for name, fmt in STOCK.items():
        assert ir.intern_repo_format(texts[name]) == fmt, name
        row = ir.with_intern_repo_data(texts[name], files, tmp_path / name, tmp_path)
        assert row == dataclasses.replace(files, data=tmp_path / name / "intern_repo")
        names = sorted(p.name for p in row.data.iterdir())
        expected = ["dialogues.bin", "dialogues.bin.meta"] if fmt == "tokenized" else None
        assert names == (expected or ["dialogues.json"]), name
        text = zoo.localized(texts[name], "sft", row)
        assert f'dataset_folder = "{row.data}"' in text, name
        assert zoo.surviving_paths(texts[name], text) == [], name
    other = texts["internlm2_chat_1_8b_qlora_alpaca_e3"]
    assert ir.with_intern_repo_data(other, files, tmp_path / "x", tmp_path) is files


def test_a_label_on_token_id_zero_is_refused():
    assert ir.signed_tokens([1, 7, 9], [-100, 7, -100]) == [-1, 7, -9]
    with pytest.raises(ValueError, match="token id 0 is a label: the tokenized format would"):
        ir.signed_tokens([0, 7], [0, 7])


def test_a_config_without_a_template_is_named():
    with pytest.raises(ValueError, match="no 'prompt_template = PROMPT_TEMPLATE.<name>' line"):
        ir.prompt_template_of("prompt_template = None\n")


def _row_config(folder: Path, tiny: Path, name: str = "internlm2_7b_w_tokenized_dataset") -> str:
    """A stock intern-repo config as the sweep edits it, its data written into ``folder``."""
    text = zoo.stock_texts()[name]
    files = zoo.LocalFiles(tiny, folder, folder / "p.jsonl", tiny, tiny)
    return zoo.localized(text, "sft", ir.with_intern_repo_data(text, files, folder, folder))


def test_the_doctor_reads_offline_packs_as_packed_rows(tmp_path, tiny):
    config = tmp_path / "row.py"
    config.write_text(_row_config(tmp_path, tiny))
    report, _ = diagnose(str(config), batches=2, progress=False)
    assert report["packed"] and report["dataset"]["packed_offline"]
    assert report["dataset"]["max_length"] == 512  # packed_length = the sweep's max_length
    assert report["dataset"]["documents"] > report["dataset"]["samples"] > 1
    assert report["samples"]["truncated"]["count"] == 0  # full rows are not cut samples
    assert "rows packed offline to 512 tokens (packed_length)" in format_summary(report)


@pytest.mark.slow
def test_offline_packs_whose_collate_drops_boundaries_train_isolated(tmp_path, tiny):
    # What a user without flash-attn does: the switch off, so the collate function drops
    # cumulative_len; the start-up must turn the collate function's on again.
    edited = sc.sub_once(
        _row_config(tmp_path, tiny), r"^use_varlen_attn = True$", "use_varlen_attn = False"
    )
    config = tmp_path / "internlm2_7b_w_tokenized_dataset.py"
    config.write_text(edited)
    cmd = [sys.executable, "-m", "xtuner.tools.train", str(config), "--work-dir"]
    cmd += [str(tmp_path / "work"), "--cfg-options", "train_cfg.max_epochs=None"]
    cmd += ["train_cfg.max_iters=1", "randomness.seed=0"]
    run = subprocess.run(cmd, cwd=sc.REPO, env=sc.venv_env(), capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "collate_fn.use_varlen_attn: default_collate_fn drops" in run.stdout + run.stderr
    sc.assert_isolated_in_run(config, tmp_path / "work")


def _every_token_trained(folder: Path) -> None:
    """Rewrite the row's tokenized file as pretraining text: every token trained (no sign)."""
    import json

    import numpy as np

    (path,) = folder.rglob("dialogues.bin")
    docs = [json.loads(line)["tokens"] for line in path.read_text().splitlines()]
    meta, offset, lines = [], 0, []
    for tokens in docs:
        lines.append(json.dumps({"tokens": [abs(t) for t in tokens]}) + "\n")
        meta.append((offset, len(tokens)))
        offset += len(lines[-1].encode("utf-8"))
    path.write_text("".join(lines))
    with open(f"{path}.meta", "wb") as f:
        np.save(f, np.array(meta, dtype=np.int64))


@pytest.mark.parametrize("what", ["dialogues", "documents"])
def test_the_cut_opt_out_of_the_tokenized_config_ends_cut_with_its_count(tmp_path, tiny, what):
    """``offline_packing = "cut"`` on ``internlm2_7b_w_tokenized_dataset``: the same verdict
    as on ``process_hf_dataset`` (a choice, exit 0, never a silent OK), in the data's words."""
    config = tmp_path / "row_cut.py"
    config.write_text(_row_config(tmp_path, tiny) + '\noffline_packing = "cut"\n')
    if what == "documents":
        _every_token_trained(tmp_path)
    report, _ = diagnose(str(config), batches=2, progress=False)
    packing = report["packing"]
    assert report["exit_code"] == 0, report["problems"]
    assert packing["cut_dialogues"] == packing["xtuner_cut"]["cut_dialogues"] > 0
    assert (
        format_summary(report)
        .splitlines()[-1]
        .startswith(
            f"CUT: {packing['cut_dialogues']} of {packing['dialogues']} {what} are trained as "
            "pieces, as this config asks"
        )
    )
    assert any(
        w.startswith(f"{packing['cut_dialogues']} of {packing['dialogues']} {what} are cut")
        for w in report["warnings"]
    )
