"""InternLM2 generates from ``inputs_embeds`` (XTuner's ``EvaluateChatHook`` with images).

transformers 4.48's ``generate`` starts with an empty ``DynamicCache``; InternLM2's modeling
code feeds ``inputs_embeds`` only when ``past_key_values is None``, so without
``transformers_internlm2.patch_internlm2_generation_from_embeds`` it dies in ``_update_causal_mask`` (checked
below on the unwrapped method: the test fails if upstream ever changes). With it, greedy
generation from the prompt's embeddings equals generation from its ids, token for token, on
XTuner's shipped class and on hub-style remote code, unpatched and patched by the plugin.
"""

import copy

import pytest
import stock_configs as sc
import torch

from xtuner_rope import compat
from xtuner_rope.models.internlm2 import patch_internlm2_attention

NEW_TOKENS = 8


@pytest.fixture(scope="module")
def remote_model(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    sc.ensure_tiny_model()
    path = sc.tiny_with_remote_code(tmp_path_factory.mktemp("embeds") / "tiny-internlm2-remote")
    return AutoModelForCausalLM.from_pretrained(
        str(path), trust_remote_code=True, torch_dtype=torch.float32
    ).eval()


def _greedy(model, **inputs) -> torch.Tensor:
    return model.generate(
        **inputs,
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
    )


@pytest.mark.parametrize("patched", [False, True])
@pytest.mark.parametrize("source", ["shipped_eager", "shipped_sdpa", "remote"])
def test_generation_from_embeds_equals_generation_from_ids(
    _tiny_models, remote_model, source, patched
):
    model = copy.deepcopy(
        remote_model if source == "remote" else _tiny_models[source.removeprefix("shipped_")]
    ).eval()
    assert "patch_internlm2_generation_from_embeds" in compat.apply()
    if patched:
        patch_internlm2_attention(model)
    ids = torch.randint(3, 256, (1, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        from_ids = _greedy(model, input_ids=ids)[:, ids.shape[1] :]
        from_embeds = _greedy(model, inputs_embeds=model.get_input_embeddings()(ids))
    assert from_embeds.shape == (1, NEW_TOKENS) and torch.equal(from_embeds, from_ids), (
        from_embeds,
        from_ids,
    )


def test_without_the_patch_generation_from_embeds_dies_upstream(remote_model):
    cls = type(remote_model)
    wrapped = cls.__dict__["prepare_inputs_for_generation"]
    assert getattr(wrapped, "_xtuner_rope_embeds", False), "remote class not patched at load"
    ids = torch.randint(3, 256, (1, 5), generator=torch.Generator().manual_seed(1))
    cls.prepare_inputs_for_generation = wrapped.__wrapped__
    try:
        with (
            torch.no_grad(),
            pytest.raises(
                RuntimeError,
                match=r"The size of tensor a \(0\) "
                r"must match the size of tensor b \(5\)",
            ),
        ):
            _greedy(remote_model, inputs_embeds=remote_model.get_input_embeddings()(ids))
    finally:
        cls.prepare_inputs_for_generation = wrapped
