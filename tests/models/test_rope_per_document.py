"""Length-dependent RoPE per document: every packed document equals itself alone (issue 31).

Dynamic NTK and LongRoPE pick their frequencies from the length served; upstream picks them per
call from the batch's longest sequence. Gold check on every transformers 4.48 ``rope_type``
(and the legacy ``type`` / ``su`` spellings) and InternLM2's classes (XTuner's shipped one and
the checkpoint's remote-code copy), eager and SDPA: one batch holds the rows [20, 100],
[100, 20], [40, 100], [70, 100], [20, 25] (thresholds 32-64: documents below and above), and
each document's logits, loss and gradients equal the document alone through the unpatched
model (fp32, 1e-5). Upstream's rotaries are stateful, so each reference document starts from
the loaded state (``reset_upstream_rotaries``, checked against a fresh copy below).
Unpacked batches and generation past the threshold match the unpatched model; with
``per_document_rope`` off the packed documents leak (the negative control).
"""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
import torch.nn.functional as F

from xtuner_rope.demo.tiny import build_tiny_hf, build_tiny_internlm2
from xtuner_rope.models import channel
from xtuner_rope.models.dispatch import patch_model
from xtuner_rope.models.rope_documents import reset_upstream_rotaries, set_per_document_rope
from xtuner_rope.ops.packing import cumulative_from_position_ids, flat_cumulative

ROWS = [[20, 100], [100, 20], [40, 100], [70, 100], [20, 25]]
VOCAB = 256
PAD_SEGMENT = 16  # padding cut into short segments of their own, as rope_collate_fn does
SHORT = [1.0 + 0.05 * i for i in range(8)]  # head_dim 16: 8 factors
LONG = [1.5 + 0.4 * i for i in range(8)]
LONGROPE = dict(max_position_embeddings=128, original_max_position_embeddings=32)
DYNAMIC = dict(max_position_embeddings=64, rope_scaling=dict(rope_type="dynamic", factor=4.0))
LLAMA3 = dict(
    rope_type="llama3",
    factor=4.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=64,
)
YARN = dict(
    max_position_embeddings=64,
    rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64),
)
# (family, rope setting) -> config overrides; thresholds 32 (LongRoPE) or 64 (dynamic NTK).
CASES = {
    ("llama", "default"): dict(max_position_embeddings=256),
    ("llama", "linear"): dict(
        max_position_embeddings=64, rope_scaling=dict(type="linear", factor=4.0)
    ),
    ("llama", "dynamic"): DYNAMIC,
    ("llama", "dynamic (type)"): dict(
        max_position_embeddings=64, rope_scaling=dict(type="dynamic", factor=4.0)
    ),
    ("llama", "yarn"): YARN,
    ("llama", "llama3"): dict(max_position_embeddings=256, rope_scaling=LLAMA3),
    ("llama", "longrope"): dict(
        **LONGROPE, rope_scaling=dict(rope_type="longrope", short_factor=SHORT, long_factor=LONG)
    ),
    ("qwen2", "dynamic"): DYNAMIC,
    ("qwen2", "yarn"): YARN,
    ("mistral", "dynamic"): DYNAMIC,
    ("mistral", "linear"): dict(
        max_position_embeddings=64, rope_scaling=dict(rope_type="linear", factor=4.0)
    ),
    ("phi3", "default"): dict(max_position_embeddings=256),
    ("phi3", "longrope"): dict(
        **LONGROPE, rope_scaling=dict(type="longrope", short_factor=SHORT, long_factor=LONG)
    ),
    ("phi3", "su"): dict(
        **LONGROPE, rope_scaling=dict(type="su", short_factor=SHORT, long_factor=LONG)
    ),
    ("internlm2", "dynamic"): dict(
        max_position_embeddings=64, rope_scaling=dict(type="dynamic", factor=2.0)
    ),
    ("internlm2", "linear"): dict(
        max_position_embeddings=64, rope_scaling=dict(type="linear", factor=4.0)
    ),
    ("internlm2 remote code", "dynamic"): dict(
        max_position_embeddings=64, rope_scaling=dict(type="dynamic", factor=2.0)
    ),
    ("internlm2 remote code", "linear"): dict(
        max_position_embeddings=64, rope_scaling=dict(type="linear", factor=4.0)
    ),
}


def _remote_code_copy(model, path):
    """``model`` saved as hub InternLM2 checkpoints ship (its modeling code, ``auto_map``) and
    loaded back through ``trust_remote_code``: the remote-code classes, not XTuner's."""
    import xtuner._lite.modelings.internlm2 as code
    from transformers import AutoModelForCausalLM

    model._auto_class = None
    model.config._auto_class = None
    model.save_pretrained(path, safe_serialization=True)
    for name in ("configuration_internlm2.py", "modeling_internlm2.py"):
        shutil.copy(f"{code.__path__[0]}/{name}", path / name)
    config = json.loads((path / "config.json").read_text())
    config["auto_map"] = {
        "AutoConfig": "configuration_internlm2.InternLM2Config",
        "AutoModelForCausalLM": "modeling_internlm2.InternLM2ForCausalLM",
    }
    (path / "config.json").write_text(json.dumps(config))
    loaded = AutoModelForCausalLM.from_pretrained(
        str(path), trust_remote_code=True, torch_dtype=torch.float32, attn_implementation="eager"
    )
    assert type(loaded).__module__.startswith("transformers_modules")
    return loaded


def build(family: str, setting: str, attn: str, tmp_path_factory=None):
    """The tiny fp32 model of a case (train mode, dropout 0)."""
    overrides = copy.deepcopy(CASES[(family, setting)])
    if family.startswith("internlm2"):
        model = build_tiny_internlm2(VOCAB, attn_implementation=attn, **overrides)
        if family != "internlm2":
            path = tmp_path_factory.mktemp("remote") / "tiny-internlm2"
            model = _remote_code_copy(model, path)
            model.config.attn_implementation = attn  # InternLM2 picks its class from it
            model = build_remote_attention(model, attn)
    else:
        model = build_tiny_hf(family, VOCAB, attn_implementation=attn, **overrides)
    return model.float().train()


def build_remote_attention(model, attn):
    """Remote-code InternLM2 built again with ``attn`` (its layers pick the class at init)."""
    if attn == "eager":
        return model
    rebuilt = type(model)(model.config)
    rebuilt.load_state_dict(model.state_dict())
    return rebuilt


def packed_batch(rows, generator):
    """``ROWS`` as one ``[b, s]`` batch; each row's tail padded with short segments."""
    s = max(sum(r) for r in rows)
    ids, positions, docs = [], [], []
    for r, row in enumerate(rows):
        tokens = [torch.randint(3, VOCAB, (n,), generator=generator) for n in row]
        pad = s - sum(row)
        cuts = [PAD_SEGMENT] * (pad // PAD_SEGMENT) + ([pad % PAD_SEGMENT] if pad % 16 else [])
        ids.append(torch.cat(tokens + [torch.zeros(pad, dtype=torch.long)]))
        positions.append(torch.cat([torch.arange(n) for n in row + cuts]))
        start = 0
        for t in tokens:
            docs.append((r, start, t))
            start += len(t)
    return torch.stack(ids), torch.stack(positions), docs


def doc_loss(logits, tokens):
    return F.cross_entropy(logits[:-1].float(), tokens[1:], reduction="sum")


def assert_same_gradients(reference, patched, ref_loss, loss):
    """Every parameter gradient of ``loss`` (patched) equals that of ``ref_loss`` (reference)."""
    loss.backward()
    ref_loss.backward()
    for (name, p), ref in zip(patched.named_parameters(), reference.parameters()):
        scale = float(ref.grad.abs().max())
        torch.testing.assert_close(p.grad, ref.grad, rtol=0, atol=1e-5 * max(scale, 1.0), msg=name)


def assert_packed_equals_alone(reference, patched, generator, host_boundaries=False):
    """Packed ``ROWS`` through ``patched`` against each document alone through ``reference``;
    ``host_boundaries``: the boundaries published on the host, as ``PackedBatchCheckHook``
    does (the lengths then come from them, not from the position ids)."""
    ids, positions, docs = packed_batch(ROWS, generator)
    if host_boundaries:
        s = positions.shape[1]
        cu = flat_cumulative([cumulative_from_position_ids(row) for row in positions], s)
        channel.publish(cu, int(positions.max()) + 1, rank=0)
    try:
        logits = patched(input_ids=ids, position_ids=positions).logits  # [b, s, V]
    finally:
        channel.clear(rank=0)
    loss, ref_loss = 0.0, 0.0
    for r, start, tokens in docs:
        reset_upstream_rotaries(reference)  # as a fresh copy: upstream's buffers are stateful
        want = reference(input_ids=tokens[None]).logits[0]
        got = logits[r, start : start + len(tokens)]
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        loss, ref_loss = loss + doc_loss(got, tokens), ref_loss + doc_loss(want, tokens)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-5)
    assert_same_gradients(reference, patched, ref_loss, loss)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("case", list(CASES), ids=lambda c: f"{c[0]}-{c[1]}")
def test_packed_documents_equal_alone(case, attn, tmp_path_factory):
    reference = build(*case, attn, tmp_path_factory)
    patched = copy.deepcopy(reference)
    patch_model(patched)
    assert_packed_equals_alone(reference, patched, torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    "case", [("llama", "dynamic"), ("phi3", "longrope"), ("internlm2", "dynamic")], ids=str
)
def test_packed_documents_equal_alone_from_host_boundaries(case):
    """The same with the batch's boundaries published on the host: the positions' range and
    each document's length are read from them (no device read), with the same numbers."""
    reference = build(*case, "sdpa")
    patched = copy.deepcopy(reference)
    patch_model(patched)
    assert_packed_equals_alone(reference, patched, torch.Generator().manual_seed(0), True)


@pytest.mark.parametrize(
    "case", [("llama", "dynamic"), ("phi3", "longrope"), ("internlm2", "dynamic")], ids=str
)
def test_per_document_off_leaks(case):
    """Negative control: with per-document frequencies off, the short documents of rows
    crossing the threshold get the long document's frequencies (upstream's per-call choice)."""
    reference = build(*case, "sdpa")
    patched = copy.deepcopy(reference)
    patch_model(patched)
    assert set_per_document_rope(patched, False) >= 1
    with pytest.raises(AssertionError, match="Mismatched elements"):
        assert_packed_equals_alone(reference, patched, torch.Generator().manual_seed(0))


@pytest.mark.parametrize("case", [("llama", "dynamic"), ("internlm2", "dynamic")], ids=str)
def test_reset_equals_a_fresh_copy(case):
    """The references' reset gives what a freshly loaded model gives; without it the state
    left by a long document changes a later one (why references must be fresh)."""
    model = build(*case, "sdpa").eval()
    fresh = copy.deepcopy(model)
    long_doc, doc = torch.randint(3, VOCAB, (1, 100)), torch.randint(3, VOCAB, (1, 64))
    want = fresh(input_ids=doc).logits
    model(input_ids=long_doc)
    stale = model(input_ids=doc).logits
    assert (stale - want).abs().max() > 1e-4  # a 64-token call keeps the grown frequencies
    assert reset_upstream_rotaries(model) >= 1
    torch.testing.assert_close(model(input_ids=doc).logits, want, rtol=0, atol=0)


@pytest.mark.parametrize(
    "case",
    [("llama", "dynamic"), ("phi3", "longrope"), ("qwen2", "dynamic"), ("llama", "default")],
    ids=str,
)
def test_reset_keeps_the_frequencies_on_the_model_device(case):
    """`.to(device)` moves the `inv_freq` buffer but not transformers' `original_inv_freq`
    attribute: the reset must not bring the frequencies back to where the model was built.
    Seen on an H100: every `xtuner-rope check` of a transformers family died in the reference
    with "mat2 is on cuda:0, different from other tensors on cpu". The meta device stands in
    for CUDA here."""
    family, scaling = case
    model = build(family, scaling, "sdpa").to("meta")
    assert reset_upstream_rotaries(model) >= 1
    devices = {m.inv_freq.device.type for m in model.modules() if hasattr(m, "original_inv_freq")}
    assert devices == {"meta"}


PADDED = [[40, 100], [70, 100], [20, 70]]  # real lengths of the rows of a right-padded batch
PADDED_CASES = [
    ("llama", "dynamic"),
    ("phi3", "longrope"),
    ("internlm2", "dynamic"),
    ("internlm2 remote code", "dynamic"),
]


def assert_padded_rows_equal_alone(reference, patched, lengths, generator):
    """A right-padded batch through ``patched``: each row's real tokens against the row alone
    through a fresh ``reference``, logits and the gradient of their summed loss."""
    s = max(lengths)
    ids = torch.randint(3, VOCAB, (len(lengths), s), generator=generator)
    mask = (torch.arange(s)[None] < torch.tensor(lengths)[:, None]).long()  # [b, s]
    logits = patched(input_ids=ids, attention_mask=mask).logits
    loss, ref_loss = 0.0, 0.0
    for r, n in enumerate(lengths):
        reset_upstream_rotaries(reference)
        want = reference(input_ids=ids[r : r + 1, :n]).logits[0]
        torch.testing.assert_close(logits[r, :n], want, rtol=0, atol=1e-5, msg=f"row {r} ({n})")
        loss, ref_loss = (
            loss + doc_loss(logits[r, :n], ids[r, :n]),
            ref_loss + doc_loss(want, ids[r, :n]),
        )
    assert_same_gradients(reference, patched, ref_loss, loss)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("case", PADDED_CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def test_padded_rows_equal_alone(case, attn, tmp_path_factory):
    """Each row of a right-padded batch gets the length-dependent frequencies of its own length
    (its last attended position + 1), as it would alone; upstream gives every row those of
    the batch's padded length (the short rows below cross no threshold alone)."""
    reference = build(*case, attn, tmp_path_factory)
    generator = torch.Generator().manual_seed(0)
    for lengths in PADDED:
        patched = copy.deepcopy(reference)
        patch_model(patched)
        reference.zero_grad()
        assert_padded_rows_equal_alone(reference, patched, lengths, generator)


@pytest.mark.parametrize("case", [("llama", "dynamic"), ("internlm2", "dynamic")], ids=str)
def test_padded_rows_without_the_row_lengths_leak(case):
    """Negative control: the unpatched padded batch (upstream's per-call choice) is off from the
    short row alone, and so is the patched one with per-document frequencies off."""
    reference = build(*case, "sdpa")
    unpatched = copy.deepcopy(reference)
    with pytest.raises(AssertionError, match="row 0"):
        assert_padded_rows_equal_alone(reference, unpatched, [40, 100], torch.Generator())
    patched = copy.deepcopy(reference)
    patch_model(patched)
    set_per_document_rope(patched, False)
    reference.zero_grad()
    with pytest.raises(AssertionError, match="row 0"):
        assert_padded_rows_equal_alone(reference, patched, [40, 100], torch.Generator())


@pytest.mark.parametrize(
    "case", [("llama", "dynamic"), ("phi3", "longrope"), ("internlm2", "dynamic")], ids=str
)
def test_generation_matches_upstream(case):
    """Greedy generation with a KV cache from 40 to 110 tokens (past the threshold) gives what
    the unpatched model gives: calls with a cache keep upstream's per-call choice."""
    reference = build(*case, "sdpa").eval()
    patched = copy.deepcopy(reference)
    patch_model(patched)
    ids = torch.randint(3, VOCAB, (2, 100))
    prompt = ids[1:, :40]
    kwargs = dict(max_new_tokens=70, do_sample=False, output_logits=True)
    kwargs.update(return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    reset_upstream_rotaries(reference)
    want = reference.generate(prompt, **kwargs)
    got = patched.generate(prompt, **kwargs)
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), atol=1e-5, rtol=0)
