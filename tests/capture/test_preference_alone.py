"""The preference capture's and check's reference (``capture.preference._values``) gives each
response what it gets alone, also on a length-dependent RoPE checkpoint.

Upstream's dynamic NTK is stateful (InternLM2's class keeps grown frequencies for good), so
running the responses of a packed row one after another through one unpatched model gives a
short response the frequencies of a long one before it unless each starts from the loaded
state. Reference here: a fresh copy of the model for every response.
"""

from __future__ import annotations

import copy

import torch

from xtuner_rope.capture.preference import _values
from xtuner_rope.capture.preference_losses import response_logp
from xtuner_rope.demo.tiny import build_tiny_internlm2

THRESHOLD = 32
RESPONSES = [50, 12, 40, 9]  # chosen, rejected, chosen, rejected: long ones first


def _pairs_row(generator: torch.Generator) -> dict:
    """One packed row of two pairs, as ``preference_collate_fn`` gives it with varlen."""
    ids = torch.cat([torch.randint(3, 256, (n,), generator=generator) for n in RESPONSES])
    labels = ids.clone()
    starts = torch.tensor([0, *RESPONSES]).cumsum(0)
    for a in starts[:-1].tolist():
        labels[a : a + 4] = -100  # the prompt
    positions = torch.cat([torch.arange(n) for n in RESPONSES])
    return {
        "input_ids": ids[None],
        "labels": labels[None],
        "position_ids": positions[None],
        "cumulative_len": [starts.to(torch.int32)],
    }


def _dynamic_llm() -> torch.nn.Module:
    """XTuner's tiny InternLM2 with dynamic NTK (factor 2) past ``THRESHOLD`` positions."""
    return build_tiny_internlm2(
        256,
        max_position_embeddings=THRESHOLD,
        rope_scaling={"type": "dynamic", "factor": 2.0},
    ).eval()


def _alone(pristine: torch.nn.Module, data: dict) -> list[float]:
    """Each response's log-prob through a fresh copy of ``pristine`` (the reference)."""
    expected = []
    bounds = data["cumulative_len"][0].tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        with torch.no_grad():
            logits = copy.deepcopy(pristine)(input_ids=data["input_ids"][:, a:b]).logits[0]
        expected.append(response_logp(logits, data["labels"][0, a:b]))
    return expected


def test_each_response_alone_starts_from_the_loaded_frequencies():
    llm = _dynamic_llm()
    data = _pairs_row(torch.Generator().manual_seed(0))
    expected = _alone(llm, data)
    bounds = data["cumulative_len"][0].tolist()
    _values(llm, data, "dpo", None, packed=True)  # the negative control first: grows the state
    got, _ = _values(llm, data, "dpo", None, packed=False)
    assert got == expected, (got, expected)
    # The state trap is real: the short response after a long one, without a fresh start.
    with torch.no_grad():
        llm(input_ids=data["input_ids"][:, : RESPONSES[0]])
        a, b = bounds[1], bounds[2]
        stale = response_logp(
            llm(input_ids=data["input_ids"][:, a:b]).logits[0], data["labels"][0, a:b]
        )
    assert abs(stale - expected[1]) > 1e-5, (stale, expected[1])


def test_packed_pairs_get_each_response_its_own_frequencies():
    """The patched policy on the packed row of pairs (boundaries published as in a run): each
    response's log-prob equals the response alone through a fresh unpatched copy."""
    from types import SimpleNamespace

    from xtuner_rope.hooks import PackedBatchCheckHook
    from xtuner_rope.models.dispatch import patch_model
    from xtuner_rope.models.rope_documents import set_per_document_rope

    pristine = _dynamic_llm()
    data = _pairs_row(torch.Generator().manual_seed(1))
    bounds = data["cumulative_len"][0].tolist()
    expected = _alone(pristine, data)
    model = copy.deepcopy(pristine)
    patch_model(model)

    def packed_logps() -> list[float]:
        hook, runner = PackedBatchCheckHook(), SimpleNamespace(model=model)
        hook.before_val(runner)
        batch = dict(data, attention_mask=torch.ones_like(data["input_ids"]).bool())
        hook.before_val_iter(runner, 0, {"data": batch, "data_samples": None})
        try:
            with torch.no_grad():
                logits = model(input_ids=data["input_ids"], position_ids=data["position_ids"])
        finally:
            PackedBatchCheckHook._reset()
        return [
            response_logp(logits.logits[0, a:b], data["labels"][0, a:b])
            for a, b in zip(bounds[:-1], bounds[1:])
        ]

    got = packed_logps()
    assert max(abs(g - e) for g, e in zip(got, expected)) <= 1e-5, (got, expected)
    # Negative control: one set of frequencies for the row (the longest response's).
    set_per_document_rope(model, False)
    shared = packed_logps()
    short = [abs(g - e) for g, e, n in zip(shared, expected, RESPONSES) if n <= THRESHOLD]
    assert max(short) > 1e-4, (shared, expected)
    print(
        f"packed pairs {RESPONSES}: max |log p packed - alone| "
        f"{max(abs(g - e) for g, e in zip(got, expected)):.3g}; per-document off {max(short):.3g}"
    )
