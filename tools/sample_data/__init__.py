"""The generator of the sample data the repository and the package ship.

``dialogues`` assembles the 2,400 short dialogues of ``xtuner_rope/demo/short_dialogues.jsonl``
(``data/short_dialogues.jsonl`` links to it) from the exchanges of ``topics`` and the fact and
phrasing tables of ``tables``; ``preference_pairs`` builds ``data/preference_pairs.jsonl`` from
them. ``python tools/make_sample_data.py`` and ``python tools/make_preference_data.py`` write the
files; ``tests/demo/`` checks the shipped bytes are what these functions generate.
"""

from tools.sample_data.dialogues import dialogue_words, generate_dialogues, to_jsonl, write_jsonl
from tools.sample_data.preference_pairs import preference_pairs, write_pairs

__all__ = [
    "dialogue_words",
    "generate_dialogues",
    "preference_pairs",
    "to_jsonl",
    "write_jsonl",
    "write_pairs",
]
