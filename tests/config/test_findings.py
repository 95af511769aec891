"""The start-up's slots: names that say what they hold; an unknown one is refused, naming them."""

from __future__ import annotations

import pytest

from xtuner_rope.config import startup
from xtuner_rope.config.findings import slot_rank


def test_an_unknown_slot_is_refused_with_the_slots_named():
    with pytest.raises(ValueError, match=r"unknown slot 'nowhere'; use one of patches, varlen"):
        slot_rank("nowhere")


def test_the_checkpoint_findings_sit_at_their_slots():
    slots = {check.__module__.rsplit(".", 1)[-1]: slot for slot, check in startup.FINDINGS}
    assert slots["checkpoint_findings"] == "llm_checkpoint"
    assert slots["accumulation"] == slots["optimizer_state"] == "checkpoint_saving"
    assert slots["patch_needs"] == "patches"


def test_the_startup_docstring_names_every_findings_module():
    named = startup.__doc__.replace("\n", " ")
    modules = {check.__module__.removeprefix("xtuner_rope.") for _, check in startup.FINDINGS}
    assert not [m for m in sorted(modules) if f"``{m}``" not in named]
