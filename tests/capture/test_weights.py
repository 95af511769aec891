"""The run's LLM weights as a plain model loads them: LoRA merged, refused under ZeRO-3.

``LLaVAIsolationCaptureHook``'s negative control gives an unpatched copy of the config's LLM
the run's weights. A LoRA run's ``state_dict`` (adapter keys, ``base_layer``) made
``load_state_dict`` die with "Missing key(s)" at iteration 1; ``plain_state_dict`` merges the
adapters into a copy first.
"""

import copy

import peft
import pytest
import torch

from xtuner_rope.capture.weights import is_peft, plain_state_dict, plain_weights_refusal


@pytest.fixture
def lora(tiny_model):
    """The tiny InternLM2 with a LoRA adapter whose B is not zero (as after some steps)."""
    plain = copy.deepcopy(tiny_model)
    model = peft.get_peft_model(
        tiny_model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["wqkv", "wo"])
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.2)
    return plain, model.eval()


def test_lora_weights_load_into_the_plain_model_and_give_its_logits(lora):
    plain, model = lora
    ids = torch.randint(3, 256, (2, 12))
    with torch.no_grad():
        base = plain(input_ids=ids).logits  # the weights before the adapter
        plain.load_state_dict(plain_state_dict(model))
        want, got = model(input_ids=ids).logits, plain(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (base - want).abs().max() > 1e-3  # the adapter matters: merging it is needed
    assert is_peft(model) and plain_weights_refusal(model, "hook") is None


def test_the_raw_lora_state_dict_is_what_failed(lora):
    plain, model = lora
    with pytest.raises(RuntimeError, match=r"Error\(s\) in loading state_dict"):
        plain.load_state_dict(model.state_dict())
