"""`xtuner_to_hf.to_hf_in_dtype`: XTuner's `to_hf` casts first (the callback) and skips its `.half()`.

XTuner's own `SupervisedFinetune.to_hf` runs here on a LoRA-shaped model whose LLM records what
is done to it; the conversions of real ZeRO-2/ZeRO-3 checkpoints with `--dtype` are in
tests/integration/test_resume.py.
"""

from __future__ import annotations

from types import SimpleNamespace

from xtuner.model.sft import SupervisedFinetune

from xtuner_rope.compat.xtuner_to_hf import TO_HF_CLASSES, to_hf_in_dtype


class RecordingLLM:
    """What XTuner's LoRA `to_hf` touches: `config`, `half()`, `save_pretrained()`."""

    def __init__(self):
        self.config = SimpleNamespace(use_cache=False)
        self.calls = []

    def half(self):
        self.calls.append("half")

    def save_pretrained(self, save_dir, **kwargs):
        self.calls.append(f"save_pretrained {save_dir}")


def _model():
    return SimpleNamespace(llm=RecordingLLM(), use_lora=True)


def test_to_hf_casts_first_and_never_halves_while_inside():
    original = vars(SupervisedFinetune)["to_hf"]
    prepared = []
    with to_hf_in_dtype(lambda model: prepared.append(model.llm.calls[:])) as classes:
        assert [cls.__name__ for cls in classes] == [name for _, name in TO_HF_CLASSES]
        model = _model()
        SupervisedFinetune.to_hf(model, cfg=None, save_dir="out", fp32=False)
    assert prepared == [[]]  # the callback ran before anything was saved
    assert model.llm.calls == ["save_pretrained out"]  # no .half()
    assert vars(SupervisedFinetune)["to_hf"] is original

    plain = _model()  # outside: XTuner's own behaviour, fp16 by .half()
    SupervisedFinetune.to_hf(plain, cfg=None, save_dir="out", fp32=False)
    assert plain.llm.calls == ["half", "save_pretrained out"]
