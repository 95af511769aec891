"""The checkpoint's RoPE read from ``config.json`` before loading: thresholds, refusals, doctor.

Length-dependent RoPE is served per document (nothing refused); what no model can compute (an
unknown ``rope_scaling`` type, a scaling without its fields) is refused by the start-up with the
setting named; the doctor's figures count the documents past the threshold and turn into a
problem only with ``per_document_rope = False``.
"""

import json

import pytest
from mmengine.config import Config

from xtuner_rope.config.findings import ConfigConflict
from xtuner_rope.config.rope_scaling import rope_scaling_findings
from xtuner_rope.config.startup import prepare_config, state_kept
from xtuner_rope.doctor.rope import rope_figures, rope_lines, rope_problems
from xtuner_rope.models.rope_documents import per_document_rope_setting
from xtuner_rope.models.rope_settings import rope_setting

LONGROPE = dict(type="longrope", short_factor=[1.0] * 8, long_factor=[2.0] * 8)


@pytest.mark.parametrize(
    "config, rope_type, threshold",
    [
        (dict(model_type="llama"), "default", None),
        (dict(model_type="llama", rope_scaling=dict(type="linear", factor=2.0)), "linear", None),
        (
            dict(
                model_type="llama",
                max_position_embeddings=64,
                rope_scaling=dict(rope_type="dynamic", factor=4.0),
            ),
            "dynamic",
            64,
        ),
        (
            dict(model_type="qwen2", rope_scaling=dict(type="yarn", factor=4.0)),
            "yarn",
            None,
        ),
        (
            dict(
                model_type="phi3",
                max_position_embeddings=1024,
                original_max_position_embeddings=64,
                rope_scaling=dict(LONGROPE, type="su"),
            ),
            "longrope",
            64,
        ),
        (  # transformers 4.48's Llama keeps the short factors whatever the length
            dict(
                model_type="llama",
                original_max_position_embeddings=64,
                rope_scaling=dict(LONGROPE, rope_type="longrope"),
            ),
            "longrope",
            None,
        ),
        (
            dict(
                model_type="internlm2",
                max_position_embeddings=32768,
                rope_scaling=dict(type="dynamic", factor=2.0),
            ),
            "dynamic",
            32768,
        ),
    ],
)
def test_rope_setting_threshold(config, rope_type, threshold):
    setting = rope_setting(config)
    assert (setting.rope_type, setting.threshold, setting.refusal) == (rope_type, threshold, None)
    assert setting.length_dependent == (threshold is not None)


def test_unserved_family_has_no_setting():
    assert rope_setting(dict(model_type="gpt_bigcode")) is None


def _checkpoint(tmp_path, **config):
    path = tmp_path / "ckpt"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return Config(dict(model=dict(llm=dict(pretrained_model_name_or_path=str(path)))))


@pytest.mark.parametrize(
    "config, message",
    [
        (
            dict(model_type="llama", rope_scaling=dict(type="ntk-by-parts", factor=2.0)),
            r"rope_scaling type 'ntk-by-parts' is not one llama computes \(known: default, "
            r"linear, dynamic, yarn, longrope, llama3\)",
        ),
        (
            dict(model_type="internlm2", rope_scaling=dict(type="yarn", factor=2.0)),
            r"type 'yarn' is not one internlm2 computes \(known: linear, dynamic, default\)",
        ),
        (
            dict(model_type="qwen2", rope_scaling=dict(rope_type="dynamic")),
            r"type 'dynamic' lacks factor, which its frequencies need",
        ),
        (
            dict(model_type="llama", rope_scaling=dict(LONGROPE, rope_type="longrope")),
            r"lacks original_max_position_embeddings \(or rope_scaling factor\)",
        ),
    ],
)
def test_start_up_refuses_what_cannot_be_computed(tmp_path, config, message):
    cfg = _checkpoint(tmp_path, **config)
    (finding,) = rope_scaling_findings(cfg)
    assert finding.setting == "model.llm.pretrained_model_name_or_path" and finding.fix is None
    with state_kept(), pytest.raises(ConfigConflict, match=message):
        prepare_config(cfg)


def test_length_dependent_rope_is_not_refused(tmp_path):
    cfg = _checkpoint(
        tmp_path,
        model_type="phi3",
        original_max_position_embeddings=64,
        rope_scaling=LONGROPE,
    )
    assert rope_scaling_findings(cfg) == []


def test_doctor_counts_documents_past_the_threshold(tmp_path):
    cfg = _checkpoint(
        tmp_path,
        model_type="llama",
        max_position_embeddings=64,
        rope_scaling=dict(type="dynamic", factor=4.0),
    )
    rope = rope_figures(cfg, [20, 64, 65, 300], packed=True)
    assert (rope["threshold"], rope["documents_past_threshold"], rope["documents"]) == (64, 2, 4)
    assert rope_lines(rope) == [
        "rope         dynamic: 2 of 4 documents longer than 64 tokens; in packed rows they get "
        "their own frequencies (per document)"
    ]
    assert rope_problems(rope) == []
    cfg.per_document_rope = False
    off = rope_figures(cfg, [20, 64, 65, 300], packed=True)
    (problem,) = rope_problems(off)
    assert problem.startswith("per_document_rope = False with dynamic RoPE: 2 documents")
    assert rope_problems(rope_figures(cfg, [20, 30], packed=True)) == []  # none crosses


class _Runner:
    def __init__(self, value):
        import torch

        self.cfg = Config(dict(per_document_rope=value))
        self.model = torch.nn.Linear(1, 1)


def test_per_document_setting_must_be_a_bool():
    assert per_document_rope_setting(_Runner(False)) is False
    with pytest.raises(TypeError, match=r"per_document_rope: expected True or False, got 'no'"):
        per_document_rope_setting(_Runner("no"))
