"""Padded InternVL and preference batches: each row gets the length-dependent RoPE of its own
length (issue 38, item 8). The LLaVA rows' test is in ``tests/data/test_llava_packing.py``.

The batches come from the real collate functions: XTuner's ``default_collate_fn`` (what the
stock InternVL configs use) and ``internvl_collate_fn(pack=False)`` for InternVL samples,
XTuner's ``preference_collate_fn`` (without varlen: chosen and rejected padded as rows of their
own) for pairs. The LLM gets what the wrappers give it: InternVL's ``_llm_forward`` calls
``language_model(inputs_embeds=..., position_ids=..., attention_mask=...)`` with the tiles'
features written at the ``<IMG_CONTEXT>`` positions; DPO/ORPO call ``self.llm(**data)``. The
tiles' features here come from a fixed random projection (standing in for InternViT + the
MLP projector: the LLM sees embeddings either way). Reference: each sample alone (collated by
``default_collate_fn``) through an unpatched copy of the model, reset to its loaded state.
Models: tiny dynamic-NTK InternLM2 (XTuner's class, threshold 64) and Llama, fp32, eager and
SDPA; rows of real lengths [40, 100], [70, 100], [20, 70] (issue 38's "done when").
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from xtuner.dataset.collate_fns import default_collate_fn
from xtuner.dataset.collate_fns.preference_collate_fn import preference_collate_fn

from xtuner_rope.data.collate_internvl import internvl_collate_fn
from xtuner_rope.demo.tiny import build_tiny_hf, build_tiny_internlm2
from xtuner_rope.hooks import PackedBatchCheckHook
from xtuner_rope.models.dispatch import patch_model
from xtuner_rope.models.rope_documents import reset_upstream_rotaries

VOCAB, CONTEXT, P, TILE = 256, 7, 4, (3, 8, 8)  # <IMG_CONTEXT> id, tokens per tile, tile shape
PADDED = [[40, 100], [70, 100], [20, 70]]
MODELS = {
    "internlm2": lambda attn: build_tiny_internlm2(
        VOCAB,
        attn_implementation=attn,
        max_position_embeddings=64,
        rope_scaling=dict(type="dynamic", factor=2.0),
    ),
    "llama": lambda attn: build_tiny_hf(
        "llama",
        VOCAB,
        attn_implementation=attn,
        max_position_embeddings=64,
        rope_scaling=dict(rope_type="dynamic", factor=4.0),
    ),
}


def _models(family: str, attn: str):
    reference = MODELS[family](attn).float()
    patched = copy.deepcopy(reference)
    patch_model(patched)
    return reference, patched


def _internvl_sample(n: int, tiles: int, g: torch.Generator) -> dict:
    """``tiles`` image tiles (``P`` context ids each) then text: ``n`` tokens in all."""
    text = torch.randint(10, VOCAB, (n - P * tiles,), generator=g).tolist()
    ids = [CONTEXT] * (P * tiles) + text
    pixels = torch.rand(tiles, *TILE, generator=g) + 0.1 if tiles else torch.zeros(1, *TILE)
    return {"input_ids": ids, "labels": [-100] * (n - len(text)) + text, "pixel_values": pixels}


def _internvl_embeds(llm, data: dict, projection: torch.Tensor) -> torch.Tensor:
    """``[b, s, C]``: the LLM's inputs as InternVL's ``_llm_forward`` builds them.

    The tiles of the batch in order, zero tiles (text-only samples) dropped as its
    ``image_flags`` drop them, their features written at the context positions in order.
    """
    pixels = data["pixel_values"]
    tiles = torch.cat(list(pixels)) if isinstance(pixels, (list, tuple)) else pixels
    tiles = tiles.reshape(-1, *TILE)  # [n_tiles, 3, 8, 8]
    tiles = tiles[tiles.flatten(1).sum(dim=1) != 0]
    embeds = llm.get_input_embeddings()(data["input_ids"]).clone()  # [b, s, C]
    features = tiles.flatten(1) @ projection  # [n_tiles, P * C]
    embeds[data["input_ids"] == CONTEXT] = features.reshape(-1, embeds.shape[-1])
    return embeds


def _publish(llm, data: dict) -> None:
    """As in a run: ``PackedBatchCheckHook`` checks the rows and publishes their boundaries."""
    hook, runner = PackedBatchCheckHook(), SimpleNamespace(model=llm)
    hook.before_val(runner)
    hook.before_val_iter(runner, 0, {"data": data, "data_samples": None})


def _internvl_logits(llm, data: dict, projection: torch.Tensor, publish=True) -> torch.Tensor:
    if publish and "cumulative_len" in data:
        _publish(llm, data)
    try:
        with torch.no_grad():
            return llm(
                inputs_embeds=_internvl_embeds(llm, data, projection),
                position_ids=data["position_ids"],
                attention_mask=data["attention_mask"],
            ).logits
    finally:
        PackedBatchCheckHook._reset()


def _assert_rows_equal_alone(logits, alone: list, lengths: list[int], what: str) -> None:
    for r, (want, n) in enumerate(zip(alone, lengths)):
        torch.testing.assert_close(
            logits[r, :n],
            want,
            rtol=0,
            atol=1e-5,
            msg=lambda m, r=r, n=n: f"{what}, row {r} ({n}): {m}",
        )


COLLATES = {
    "default_collate_fn": lambda items: default_collate_fn(items, return_hf_format=True),
    "internvl_collate_fn(pack=False)": lambda items: internvl_collate_fn(
        items, max_length=128, pack=False, return_hf_format=True
    ),
}


@pytest.mark.parametrize("collate", list(COLLATES))
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", list(MODELS))
def test_padded_internvl_rows_equal_each_sample_alone(family, attn, collate):
    reference, patched = _models(family, attn)
    g = torch.Generator().manual_seed(0)
    hidden = reference.config.hidden_size
    projection = torch.randn(TILE[0] * TILE[1] * TILE[2], P * hidden, generator=g) * 0.02
    for lengths in PADDED:
        items = [_internvl_sample(lengths[0], 2, g), _internvl_sample(lengths[1], 0, g)]
        logits = _internvl_logits(patched, COLLATES[collate](items), projection)
        alone = []
        for item in items:
            reset_upstream_rotaries(reference)  # dynamic NTK is stateful upstream
            alone.append(
                _internvl_logits(
                    reference, default_collate_fn([item], return_hf_format=True), projection
                )
            )
        _assert_rows_equal_alone(logits, [a[0] for a in alone], lengths, collate)
    # Negative control: upstream gives the short row the padded batch's frequencies.
    items = [_internvl_sample(40, 2, g), _internvl_sample(100, 0, g)]
    with pytest.raises(AssertionError, match="row 0"):
        # (no boundaries published: PackedBatchCheckHook refuses them for an unpatched model)
        unpatched = _internvl_logits(reference, COLLATES[collate](items), projection, False)
        reset_upstream_rotaries(reference)
        want = _internvl_logits(
            reference, default_collate_fn(items[:1], return_hf_format=True), projection
        )
        _assert_rows_equal_alone(unpatched, [want[0]], [40], "unpatched")


def _pair(chosen: int, rejected: int, g: torch.Generator) -> dict:
    pair = {}
    for name, n in (("chosen", chosen), ("rejected", rejected)):
        ids = torch.randint(3, VOCAB, (n,), generator=g).tolist()
        pair[f"{name}_ids"], pair[f"{name}_labels"] = ids, [-100] * (n // 2) + ids[n // 2 :]
    return pair


def _preference_logits(llm, data: dict) -> torch.Tensor:
    """What DPO/ORPO's ``self.llm(**data)`` returns, without the labels (no loss needed)."""
    with torch.no_grad():
        return llm(**{k: v for k, v in data.items() if k != "labels"}).logits


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", list(MODELS))
def test_padded_preference_rows_equal_each_response_alone(family, attn):
    """``preference_collate_fn`` without varlen: rows chosen, rejected, chosen, ... padded to
    the longest; each response equals itself alone."""
    reference, patched = _models(family, attn)
    g = torch.Generator().manual_seed(1)
    for lengths in PADDED:
        pairs = [_pair(*lengths, g), _pair(lengths[1] // 2, lengths[0], g)]
        data = preference_collate_fn(pairs, return_hf_format=True)
        rows = [
            len(pairs[i // 2]["chosen_ids" if i % 2 == 0 else "rejected_ids"]) for i in range(4)
        ]
        assert data["input_ids"].shape == (4, max(rows))
        logits = _preference_logits(patched, data)
        alone = []
        for r, n in enumerate(rows):
            reset_upstream_rotaries(reference)
            alone.append(
                _preference_logits(reference, {"input_ids": data["input_ids"][r : r + 1, :n]})[0]
            )
        _assert_rows_equal_alone(logits, alone, rows, "preference_collate_fn")
    data = preference_collate_fn([_pair(40, 100, g)], return_hf_format=True)
    with pytest.raises(AssertionError, match="row 0"):
        unpatched = _preference_logits(reference, data)
        reset_upstream_rotaries(reference)
        want = _preference_logits(reference, {"input_ids": data["input_ids"][:1, :40]})
        _assert_rows_equal_alone(unpatched, [want[0]], [40], "unpatched")
