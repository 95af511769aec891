"""The families added through ``models.families`` (Phi-3, Mixtral, Qwen2-MoE, Gemma, Cohere)
against their live, unpatched transformers models; the start-up refusal of what is not served.

Gold standard: a packed batch gives each document the logits, loss and gradients it gets
alone (fp32, <= 1e-5), on eager and SDPA, batch sizes 1 and 2; the unpatched model leaks.
"""

import copy
import json

import gold
import pytest
import torch
from test_models_hf import ROWS, packed_batch, per_document, publish  # noqa: F401 - fixture
from transformers import Phi3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

from xtuner_rope.config import startup
from xtuner_rope.config.findings import ConfigConflict
from xtuner_rope.demo.tiny import build_tiny_hf
from xtuner_rope.doctor.diagnose import diagnose
from xtuner_rope.models import HF_ATTENTION_CLASSES, HFValidatedRotaryEmbedding, integration_for
from xtuner_rope.models.dispatch import patch_model
from xtuner_rope.models.families import FAMILIES, checkpoint_verdict

# Each family's quirk comes from demo.tiny.FAMILY_KWARGS (MoE experts, Gemma's MQA and
# head_dim 32 != 64 / 4, tied embeddings); these add the variants worth a separate run.
VARIANTS = {
    "phi3": ("phi3", dict(sliding_window=64)),
    "mixtral": ("mixtral", dict(sliding_window=64)),
    "qwen2_moe": ("qwen2_moe", {}),
    "gemma": ("gemma", {}),
    "cohere": ("cohere", dict(use_qk_norm=False)),
    "cohere_qk_norm": ("cohere", dict(use_qk_norm=True)),
}
LONGROPE = dict(
    original_max_position_embeddings=64,
    max_position_embeddings=256,
    rope_scaling=dict(
        type="longrope",
        short_factor=[1.0 + i / 8 for i in range(8)],
        long_factor=[2.0 + i for i in range(8)],
    ),
)


def build(variant, attn, **overrides):
    """The tiny fp32 model of ``variant`` (2 layers, hidden 64, vocab 256, 256 positions)."""
    family, extra = VARIANTS[variant]
    return build_tiny_hf(
        family,
        256,
        attn_implementation=attn,
        **{"max_position_embeddings": 256, **extra, **overrides},
    )


def gold_check(model, bs, source="positions", publisher=None):
    """Patch a copy of ``model``; assert packed = each document alone (logits, loss, grads)."""
    model = model.train()
    reference = copy.deepcopy(model)
    count, _ = patch_model(model)
    assert count == 2
    ids, pos, labels, cus = packed_batch(bs)
    if source == "hub":
        publisher(cus, ids.shape[1])
    out = model(ids, position_ids=pos, labels=labels)
    ref_logits, ref_sum = per_document(reference, ids, ROWS[:bs])
    assert (out.logits - ref_logits).abs().max() <= 1e-5
    n_targets = sum(n - 1 for row in ROWS[:bs] for n in row)
    torch.testing.assert_close(out.loss, ref_sum / n_targets, rtol=1e-6, atol=1e-6)
    out.loss.backward()
    (ref_sum / n_targets).backward()
    for (name, p), r in zip(model.named_parameters(), reference.parameters()):
        if r.grad is None:  # an expert no token of this batch was routed to
            assert p.grad is None or not p.grad.any(), name
            continue
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-4, atol=2e-6, msg=name)


@pytest.mark.parametrize("bs", [1, 2])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_packed_equals_each_document_alone(variant, attn, bs):
    gold_check(build(variant, attn), bs)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_published_boundaries_isolate_documents(variant, publish):  # noqa: F811
    gold_check(build(variant, "sdpa"), 2, source="hub", publisher=publish)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_unpatched_model_leaks_across_documents(variant, attn):
    model = build(variant, attn)
    ids, pos, _, _ = packed_batch(1)
    ref_logits, _ = per_document(model, ids, ROWS[:1])
    assert (model(ids, position_ids=pos).logits - ref_logits).abs().max() > 1e-2


@pytest.mark.parametrize("variant", ["phi3", "qwen2_moe", "gemma", "cohere_qk_norm"])
def test_greedy_generation_unchanged(variant):
    model = build(variant, "sdpa")
    reference = copy.deepcopy(model)
    patch_model(model)
    ids = torch.randint(1, 256, (2, 7))
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0  # row 1 left-padded
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False)
    torch.testing.assert_close(
        model.generate(ids, **kwargs), reference.generate(ids, **kwargs), rtol=0, atol=0
    )


@pytest.mark.parametrize("variant", ["mixtral", "qwen2_moe"])
def test_moe_routing_per_token_equals_alone(variant):
    model = build(variant, "sdpa")
    reference = copy.deepcopy(model)
    patch_model(model)
    ids, pos, _, _ = packed_batch(2)
    packed = model(ids, position_ids=pos, output_router_logits=True).router_logits
    for layer, router in enumerate(packed):  # [b * s, experts] per layer
        router = router.view(2, ids.shape[1], -1)
        for r, row in enumerate(ROWS):
            start = 0
            for n in row:
                alone = reference(
                    ids[r : r + 1, start : start + n], output_router_logits=True
                ).router_logits[layer]  # [n, experts]
                assert (router[r, start : start + n] - alone).abs().max() <= 1e-5, (layer, r, start)
                start += n


@pytest.mark.parametrize("family", ["gemma", "cohere", "qwen2_moe"])
def test_bfloat16_packed_equals_alone(family):
    # Cohere's own apply_rotary_pos_emb upcasts to fp32 and rotates interleaved pairs: it keeps
    # it (no fp32 wrapper); the others get models.hf_rope.patch_hf_fp32_rotation.
    reference, patched = gold.build_pair(family, torch.bfloat16)
    gold.check_packed_equals_alone(reference, patched, 2)
    rotary = patched.model.rotary_emb
    assert isinstance(rotary, HFValidatedRotaryEmbedding)
    assert rotary.inv_freq.dtype == torch.float32 and rotary.interleaved == (family == "cohere")


def test_family_table_keeps_the_old_names():
    assert {
        "LlamaAttention",
        "Qwen2Attention",
        "MistralAttention",
        "Phi3Attention",
        "MixtralAttention",
        "GemmaAttention",
        "CohereAttention",
        "Qwen2MoeSdpaAttention",
    } <= set(HF_ATTENTION_CLASSES)
    assert FAMILIES["cohere"].interleaved and not FAMILIES["cohere"].fp32_apply
    assert integration_for(build("qwen2_moe", "eager")) == "hf"
    assert patch_model(build("qwen2_moe", "sdpa")) == (2, "Qwen2Moe")  # named as in the log


@pytest.mark.parametrize("kind", ["longrope", "su"])
def test_phi3_longrope_matches_transformers(kind):
    scaling = dict(LONGROPE["rope_scaling"], type=kind)
    config = Phi3Config(
        hidden_size=64, num_attention_heads=4, **{**LONGROPE, "rope_scaling": scaling}
    )
    ours, theirs = HFValidatedRotaryEmbedding(config), Phi3RotaryEmbedding(config)
    short, factor = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu")
    torch.testing.assert_close(ours.inv_freq, short, rtol=0, atol=0)
    assert ours.rope_type == "longrope" and ours.attention_scaling == factor > 1
    for length in (40, 64, 65, 200):  # short factors up to 64 positions, long ones beyond
        positions, x = torch.arange(length)[None], torch.zeros(1, length, 8)
        torch.testing.assert_close(ours(x, positions), theirs(x, positions), rtol=0, atol=0)
    # Packed: the 100-token document gets the long factors, the 20-token one the short ones,
    # each as it gets them alone (issue 31; this was refused before).
    packed = torch.cat([torch.arange(100), torch.arange(20)])[None]
    cos, sin = ours(torch.zeros(1, 120, 8), packed)
    for a, n in ((0, 100), (100, 20)):
        alone = theirs(torch.zeros(1, n, 8), torch.arange(n)[None])
        torch.testing.assert_close((cos[:, a : a + n], sin[:, a : a + n]), alone, rtol=0, atol=0)


@pytest.mark.parametrize("bs", [1, 2])
def test_phi3_longrope_packed_equals_alone(bs):
    gold_check(build("phi3", "sdpa", **LONGROPE), bs)


def _checkpoint(tmp_path, name, **config):
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


SMALL_CONFIG = """\
from datasets import load_dataset
from xtuner_rope.data.collate import rope_collate_fn
from xtuner_rope.config.startup import enable_xtuner_rope

pretrained_model_name_or_path = {llm!r}
model_resource = dict(fn=enable_xtuner_rope)
model = dict(llm=dict(pretrained_model_name_or_path=pretrained_model_name_or_path))
train_dataloader = dict(
    batch_size=2,
    dataset=dict(type=load_dataset, path="json", data_files={data!r}, split="train"),
    collate_fn=dict(type=rope_collate_fn, pack=True, max_length=8),
)
"""
REFUSED = [
    (
        "starcoder",
        dict(model_type="gpt_bigcode", architectures=["GPTBigCodeForCausalLM"]),
        r"GPT-BigCode \(StarCoder\) cannot be served by xtuner-rope: it has no rotary",
    ),
    (
        "internlm",
        dict(model_type="internlm", auto_map={"AutoModelForCausalLM": "m.M"}),
        r"InternLM \(1\) cannot be served by xtuner-rope: its modeling code is a checkpoint's "
        "remote code",
    ),
    ("chatglm3", dict(model_type="chatglm"), r"ChatGLM 2/3 cannot be served"),
    (
        "other",
        dict(model_type="my_llm", auto_map={}),
        r"my_llm cannot be served by xtuner-rope: xtuner-rope has no integration for it \(its "
        r"modeling code is the checkpoint's own remote code: auto_map \{\}\)",
    ),
]


@pytest.mark.parametrize("name, config, message", REFUSED, ids=[r[0] for r in REFUSED])
def test_start_up_refuses_unserved_families_before_loading(tmp_path, name, config, message):
    # Only config.json exists: no weight could have been loaded for the refusal.
    llm = _checkpoint(tmp_path, name, **config)
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}) + "\n")
    path = tmp_path / "config.py"
    path.write_text(SMALL_CONFIG.format(llm=llm, data=str(data)))
    from mmengine.config import Config

    with pytest.raises(
        ConfigConflict,
        match=r"model.llm.pretrained_model_name_or_path: "
        f".*{message}.*\n  -> use a checkpoint of a "
        "served family",
    ):
        startup.prepare_config(Config.fromfile(str(path)))
    report, _ = diagnose(str(path), progress=False)  # the doctor says so too, exit 1
    assert report["exit_code"] == 1
    assert [c["setting"] for c in report["findings"]["conflicts"]] == [
        "model.llm.pretrained_model_name_or_path"
    ]


def test_served_and_unknowable_checkpoints_are_not_refused(tmp_path):
    for model_type in ("phi3", "mixtral", "qwen2_moe", "gemma", "cohere", "llama", "internlm2"):
        where, refusal = checkpoint_verdict(
            _checkpoint(tmp_path, model_type, model_type=model_type)
        )
        assert refusal is None and model_type in where
    # A config.json that cannot be read (a hub id offline, a directory without one): no
    # verdict here (config.checkpoint_findings refuses it); no model_type: ValidatedRoPEHook
    # refuses such a model after loading.
    assert checkpoint_verdict("no-such-org/no-such-model") is None
    assert checkpoint_verdict(str(tmp_path)) is None
    assert checkpoint_verdict(_checkpoint(tmp_path, "untyped", architectures=["X"])) is None


def test_tiny_checkpoints_of_the_new_families_load_with_transformers(tmp_path):
    # What tools/make_tiny.py --family F writes (save_tiny), loaded back by plain transformers.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from xtuner_rope.demo.tiny import save_tiny

    for family in ("phi3", "mixtral", "qwen2_moe", "gemma", "cohere"):
        path = save_tiny(tmp_path / family, family)
        model = AutoModelForCausalLM.from_pretrained(path)
        assert type(model).__module__ == FAMILIES[family].module
        fresh = build_tiny_hf(family, len(AutoTokenizer.from_pretrained(path)))
        for (name, p), q in zip(model.state_dict().items(), fresh.state_dict().values()):
            torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)  # seeded: the same
        assert patch_model(model)[0] == 2
