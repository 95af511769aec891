"""XTuner's config zoo, swept as a new user meets it: one row per stock config, and its classes.

A maintainer's tool (``python -m tools.zoo``, from the repository root), outside the wheel: it
drives the package's captures and doctor, and the package never imports it. For each stock
config (``xtuner list-cfg``, filtered by pattern) a row (:mod:`~tools.zoo.run`)

1. copies it as ``xtuner copy-cfg`` does (XTuner's copy steps, in the sweep's process);
2. points every model, data and folder path setting at a tiny random checkpoint of its family
   built here and small local data in every stock format (:mod:`~tools.zoo.localize`,
   :mod:`~tools.zoo.data`, :mod:`~tools.zoo.internvl` for InternVL configs; a family without
   a tiny builder keeps its hub id on purpose, any other hub or cluster path left behind is a sweep error, not a row), makes the CPU
   edits, the README's one edit and a capture hook;
3. runs ``xtuner-rope doctor`` on it, then a few iterations of the real training script
   (``python -m xtuner.tools.train``, which returns 1 on failure, unlike ``xtuner train``);
4. where it trained, compares each document of the captured batch with the same document alone
   (:mod:`~tools.zoo.judge`): "trained isolated" needs a row that held two documents or
   more, else "not exercised".

Each row's outcome is one of :data:`OUTCOMES`, with the doctor's verdict, its reasons, and
whether the doctor predicted it (:func:`doctor_agrees`). :mod:`~tools.zoo.classes` sorts
all stock configs into classes from their text; :mod:`~tools.zoo.table` writes the rows
and the classes with the rows that cover them.
"""

from tools.zoo.classes import classify, coverage, kind_of, mode_of, stock_texts, zoo_classes
from tools.zoo.data import (
    tiny_checkpoint,
    write_llava_images,
    write_preference_data,
    write_universal_data,
)
from tools.zoo.judge import (
    CRASHED,
    ISOLATION_TOLERANCE,
    LACKS,
    LEAKED,
    NOT_A_TRAINING_CONFIG,
    NOT_EXERCISED,
    OUTCOMES,
    REFUSED,
    REFUSED_AT_DATA,
    SWEEP_ERROR,
    TRAINED,
    doctor_agrees,
    doctor_reasons,
    isolation_tolerance,
    judge_capture,
    judge_run,
    lacks_of,
    refused_settings,
    rejudge,
)
from tools.zoo.localize import (
    CHAT_SAMPLE_TOKENS,
    LocalFiles,
    cpu_edits,
    enable_plugin,
    enable_plugin_llava,
    family_of,
    localize,
    localize_llava,
    localized,
    one_map_process,
    path_literals,
    set_in_dicts,
    short_chat_samples,
    surviving_paths,
    with_capture,
)
from tools.zoo.run import list_configs, load_results, run_row, select, sweep
from tools.zoo.table import classes_markdown, counts, markdown

__all__ = [
    "CHAT_SAMPLE_TOKENS",
    "CRASHED",
    "ISOLATION_TOLERANCE",
    "LACKS",
    "LEAKED",
    "NOT_A_TRAINING_CONFIG",
    "NOT_EXERCISED",
    "OUTCOMES",
    "REFUSED",
    "REFUSED_AT_DATA",
    "SWEEP_ERROR",
    "TRAINED",
    "LocalFiles",
    "classes_markdown",
    "classify",
    "counts",
    "coverage",
    "cpu_edits",
    "doctor_agrees",
    "doctor_reasons",
    "enable_plugin",
    "enable_plugin_llava",
    "family_of",
    "isolation_tolerance",
    "judge_capture",
    "judge_run",
    "kind_of",
    "lacks_of",
    "list_configs",
    "load_results",
    "localize",
    "localize_llava",
    "localized",
    "one_map_process",
    "markdown",
    "mode_of",
    "path_literals",
    "refused_settings",
    "rejudge",
    "run_row",
    "select",
    "set_in_dicts",
    "short_chat_samples",
    "stock_texts",
    "surviving_paths",
    "sweep",
    "tiny_checkpoint",
    "with_capture",
    "zoo_classes",
    "write_llava_images",
    "write_preference_data",
    "write_universal_data",
]
