"""The sweep's data for XTuner's intern-repo datasets (InternEvo's formats), from our dialogues.

XTuner 0.2.0 (``xtuner/dataset/intern_repo.py``) reads two formats from a ``dataset_folder``,
walking it for every file with the loader's suffix:

- **tokenized** (``load_intern_repo_tokenized_dataset``, ``.bin``): one JSON object a line,
  ``{"tokens": [...]}``, where a token the loss must skip is stored negated (XTuner takes
  ``abs()`` for ``input_ids`` and gives every id ``<= 0`` the label -100); beside each file a
  ``<file>.bin.meta``, a numpy array ``[n, 2]`` of (byte offset, token count) per line, read
  with ``np.load`` (only column 0 and the last column are used).
- **untokenized** (``load_intern_repo_untokenized_dataset``, ``.json``): one dialogue a line,
  the line being the bare list of OpenAI messages (no ``"messages"`` key); XTuner wraps it,
  maps it with ``openai_map_fn`` and encodes it with the config's ``prompt_template``.

Both end in ``build_packed_dataset``, which packs the documents offline into rows of
``packed_length`` tokens with their ``cumulative_len`` (a document cut at a row's edge goes on
in the next row, its positions restarting at 0). The tokenized files are written with the row's
own tokenizer and template through XTuner's ``openai_map_fn``, ``template_map_fn_factory`` and
``encode_fn``: the same tokens the untokenized path trains on, so token ids are in range.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

from tools.zoo.data import tiny_checkpoint
from tools.zoo.localize import LocalFiles

# The loader a stock config names -> the format it reads.
LOADERS = {
    "load_intern_repo_tokenized_dataset": "tokenized",
    "load_intern_repo_untokenized_dataset": "untokenized",
}
# Dialogues per file: a few thousand tokens, dozens of 512-token packed rows.
DIALOGUES = 240


def intern_repo_format(text: str) -> str | None:
    """``'tokenized'``/``'untokenized'``: the intern-repo loader a config's text builds, or None."""
    return next((fmt for name, fmt in LOADERS.items() if f"type={name}" in text), None)


def prompt_template_of(text: str) -> str:
    """The ``PROMPT_TEMPLATE`` entry a config's ``prompt_template`` setting names.

    Raises:
        ValueError: The config sets no ``prompt_template = PROMPT_TEMPLATE.<name>``.
    """
    found = re.search(r"^prompt_template = PROMPT_TEMPLATE\.(\w+)", text, re.M)
    if found is None:
        raise ValueError(
            "zoo: the intern-repo config has no 'prompt_template = PROMPT_TEMPLATE.<name>' "
            "line: cannot encode its tokenized data"
        )
    return found.group(1)


def _dialogues(n: int) -> list[list[dict]]:
    from tools.sample_data import generate_dialogues

    return [d["messages"] for d in generate_dialogues(n, seed=0)]


def write_untokenized(folder: Path, n: int = DIALOGUES) -> Path:
    """``folder/dialogues.json``: one JSON list of messages a line (the untokenized format).

    Returns:
        The file written.
    """
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "dialogues.json"
    lines = (json.dumps(messages, ensure_ascii=False) for messages in _dialogues(n))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def signed_tokens(input_ids: list[int], labels: list[int]) -> list[int]:
    """InternEvo's token list: an id as it is where it is trained on, negated where not.

    Raises:
        ValueError: A trained token has id 0, which the format cannot mark as trained.
    """
    if any(i == 0 and lab != -100 for i, lab in zip(input_ids, labels)):
        raise ValueError("zoo: token id 0 is a label: the tokenized format would drop it")
    return [i if lab != -100 else -i for i, lab in zip(input_ids, labels)]


def encoded_dialogues(tokenizer_dir: Path, template: str, n: int = DIALOGUES) -> list[dict]:
    """The sample dialogues as XTuner encodes them: ``openai_map_fn``, the template, ``encode_fn``.

    Args:
        tokenizer_dir: The row's tokenizer (its tiny checkpoint).
        template: A ``PROMPT_TEMPLATE`` name (the config's ``prompt_template``).
        n: How many dialogues.

    Returns:
        ``[{'input_ids': [...], 'labels': [...]}]``, one per dialogue, untruncated.
    """
    from transformers import AutoTokenizer
    from xtuner.dataset.map_fns import openai_map_fn, template_map_fn_factory
    from xtuner.dataset.utils import encode_fn
    from xtuner.utils import PROMPT_TEMPLATE

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), trust_remote_code=True)
    apply_template = template_map_fn_factory(template=PROMPT_TEMPLATE[template])
    encoded = []
    for messages in _dialogues(n):
        example = openai_map_fn({"messages": messages})
        example.update(apply_template(example))
        out = encode_fn(example, tokenizer, max_length=10**6, input_ids_with_output=True)
        encoded.append({"input_ids": out["input_ids"], "labels": out["labels"]})
    return encoded


def write_tokenized(folder: Path, tokenizer_dir: Path, template: str, n: int = DIALOGUES) -> Path:
    """``folder/dialogues.bin`` and its ``.bin.meta`` (the tokenized format), encoded with the
    row's tokenizer and template (:func:`encoded_dialogues`).

    Returns:
        The ``.bin`` file written.
    """
    import numpy as np

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "dialogues.bin"
    meta, offset = [], 0
    with open(path, "wb") as f:
        for doc in encoded_dialogues(tokenizer_dir, template, n):
            line = (json.dumps({"tokens": signed_tokens(**doc)}) + "\n").encode("utf-8")
            meta.append((offset, len(doc["input_ids"])))
            f.write(line)
            offset += len(line)
    with open(f"{path}.meta", "wb") as f:  # np.save to a handle: no ``.npy`` suffix added
        np.save(f, np.array(meta, dtype=np.int64))
    return path


def intern_repo_data(text: str, folder: Path, tokenizer_dir: Path) -> Path | None:
    """The folder a stock intern-repo config's ``dataset_folder`` points at, written in the
    format its loader reads (:func:`intern_repo_format`); None for any other config.

    Args:
        text: The stock config's text.
        folder: Where to write (the row's own folder: rows never share it).
        tokenizer_dir: The row's tokenizer (tokenized format only).
    """
    fmt = intern_repo_format(text)
    if fmt == "untokenized":
        write_untokenized(folder)
    elif fmt == "tokenized":
        write_tokenized(folder, tokenizer_dir, prompt_template_of(text))
    return folder if fmt else None


def with_intern_repo_data(text: str, files: LocalFiles, folder: Path, models: Path) -> LocalFiles:
    """A row's local files with its data folder replaced by intern-repo data when the stock
    config reads an intern-repo dataset (:func:`intern_repo_data`), else ``files`` unchanged.

    The data is encoded with the row's tiny tokenizer; a family without a tiny builder (its
    hub id stays, the row cannot load it here) gets the tiny InternLM2's.
    """
    if intern_repo_format(text) is None:
        return files  # nothing built, nothing written
    tokenizer_dir = files.model or tiny_checkpoint("internlm2", models)
    data = intern_repo_data(text, folder / "intern_repo", tokenizer_dir)
    return dataclasses.replace(files, data=data)
