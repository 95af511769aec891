"""Greedy generation through the patched attention equals the unpatched model, token for token,
under both KV-cache contracts: XTuner's current classes (a transformers ``Cache``) and the
first-generation remote code (per-layer ``(k, v)`` tuples, see ``legacy_internlm2``)."""

import copy

import pytest
import torch
from legacy_internlm2 import causal_mask_with_past, legacy_from
from transformers.cache_utils import DynamicCache

from xtuner_rope.models.internlm2 import patch_internlm2_attention

CONTRACTS = ("eager", "sdpa", "legacy")  # XTuner's classes per attn_implementation; old code
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def _references(_tiny_models):
    """Unpatched models per contract, all with the weights of the tiny eager model."""
    return {**_tiny_models, "legacy": legacy_from(_tiny_models["eager"])}


def _pair(references, contract):
    """(unpatched, patched) fresh copies of one contract's model."""
    ref = copy.deepcopy(references[contract])
    patched = copy.deepcopy(ref)
    patch_internlm2_attention(patched)
    return ref, patched


def _prompts(batch):
    """Prompt ids and mask: one row, or two rows LEFT-padded to a common length (9 and 5)."""
    if batch == "one":
        return torch.randint(3, 256, (1, 7)), None
    ids = torch.randint(3, 256, (2, 9))
    mask = torch.ones_like(ids)
    ids[1, :4], mask[1, :4] = 0, 0
    return ids, mask


def _generate(model, ids, mask, use_cache):
    """Greedy ``generate`` of exactly NEW_TOKENS tokens; also the cache types layer 0 received."""
    seen = set()
    hook = model.model.layers[0].attention.register_forward_pre_hook(
        lambda module, args, kwargs: seen.add(type(kwargs.get("past_key_value"))), with_kwargs=True
    )
    try:
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
            use_cache=use_cache,
            output_scores=True,
            return_dict_in_generate=True,
        )
    finally:
        hook.remove()
    return out.sequences, torch.stack(out.scores), seen  # scores: [new, b, vocab]


@pytest.mark.parametrize("batch", ["one", "left_padded"])
@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("contract", CONTRACTS)
def test_greedy_generation_matches_unpatched(_references, contract, use_cache, batch):
    ref, patched = _pair(_references, contract)
    ids, mask = _prompts(batch)
    want_ids, want_scores, want_seen = _generate(ref, ids, mask, use_cache)
    got_ids, got_scores, got_seen = _generate(patched, ids, mask, use_cache)
    # The layers really saw the contract under test, patched or not.
    expected = {type(None)}
    if use_cache:
        expected = {type(None), tuple} if contract == "legacy" else {DynamicCache}
    assert want_seen == got_seen == expected
    assert got_ids.shape == (ids.shape[0], ids.shape[1] + NEW_TOKENS)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_scores, want_scores, atol=1e-5, rtol=1e-5)


def test_first_decoding_step_returns_present_for_tuple_contract(_references):
    ref, patched = _pair(_references, "legacy")
    ids, mask = _prompts("left_padded")
    want, got = (
        ref(ids, attention_mask=mask, use_cache=True),
        patched(ids, attention_mask=mask, use_cache=True),
    )
    n_kv, h_d = (
        ref.config.num_key_value_heads,
        ref.config.hidden_size // ref.config.num_attention_heads,
    )
    assert isinstance(got.past_key_values, tuple) and len(got.past_key_values) == 2  # per layer
    for (got_k, got_v), (want_k, want_v) in zip(got.past_key_values, want.past_key_values):
        assert got_k.shape == got_v.shape == (2, n_kv, ids.shape[1], h_d)
        torch.testing.assert_close(got_k, want_k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got_v, want_v, atol=1e-5, rtol=1e-5)
    # The present feeds the next step: one new token at positions 9 and 5 (row 1 is padded).
    step = dict(
        input_ids=torch.tensor([[7], [8]]),
        attention_mask=torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1),
        position_ids=torch.tensor([[9], [5]]),
        use_cache=True,
    )
    want = ref(past_key_values=want.past_key_values, **step)
    got = patched(past_key_values=got.past_key_values, **step)
    torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=1e-5)
    assert got.past_key_values[0][0].shape[2] == ids.shape[1] + 1
    assert patched(ids, attention_mask=mask, use_cache=False).past_key_values is None


@pytest.mark.parametrize("contract", CONTRACTS)
def test_rope_follows_the_cache_when_position_ids_is_none(_references, contract):
    ref, patched = _pair(_references, contract)
    ref_layer, layer = ref.model.layers[0].attention, patched.model.layers[0].attention
    hidden = torch.randn(1, 7, ref.config.hidden_size)

    def run(attn, later_positions):
        """Prefill 5 tokens, then 2 more on the cache; the output of the 2 new tokens."""
        past = DynamicCache() if contract != "legacy" else None
        mask = causal_mask_with_past(None, 1, 5, 0, hidden.dtype, hidden.device)
        _, _, present = attn(
            hidden[:, :5],
            attention_mask=mask,
            position_ids=torch.arange(5)[None],
            past_key_value=past,
            use_cache=True,
        )
        mask = causal_mask_with_past(None, 1, 2, 5, hidden.dtype, hidden.device)
        return attn(
            hidden[:, 5:],
            attention_mask=mask,
            position_ids=later_positions,
            past_key_value=present,
            use_cache=True,
        )[0]

    with torch.no_grad():
        torch.testing.assert_close(
            run(layer, None), run(ref_layer, torch.arange(5, 7)[None]), atol=1e-5, rtol=1e-5
        )


def test_cache_object_on_a_layer_without_layer_idx_is_refused(_references):
    _, patched = _pair(_references, "legacy")
    layer = patched.model.layers[0].attention
    with pytest.raises(
        TypeError,
        match=r"InternLM2Attention received a transformers Cache as "
        r"past_key_value but has no layer_idx",
    ):
        layer(
            torch.randn(1, 4, 64),
            position_ids=torch.arange(4)[None],
            past_key_value=DynamicCache(),
            use_cache=True,
        )


def test_whole_model_tuple_given_to_one_layer_is_refused(_references):
    _, patched = _pair(_references, "legacy")
    layer = patched.model.layers[0].attention
    pair = (torch.zeros(1, 2, 3, 16), torch.zeros(1, 2, 3, 16))
    with pytest.raises(
        TypeError,
        match=r"past_key_value must be a transformers Cache, None, or "
        r"this layer's \(key, value\) pair .* got tuple of 2 "
        r"tuple, tuple",
    ):
        layer(
            torch.randn(1, 1, 64),
            position_ids=torch.tensor([[3]]),
            past_key_value=(pair, pair),
            use_cache=True,
        )
