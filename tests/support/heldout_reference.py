"""The plain held-out loss of a checkpoint: each dialogue whole and alone, no xtuner-rope.

``python heldout_reference.py CONFIG CHECKPOINT [CONVERTED]`` builds the config's held-out dataset with
XTuner's own ``process_hf_dataset`` unpacked (``pack_to_max_length=False``: one dialogue per
sample), loads the config's LLM with ``from_pretrained`` (unpatched, fp32, eager attention),
puts in the weights the run evaluated (``module_weights``; a LoRA run's checkpoint holds the
adapter only, merged here by hand into the base weights: ``merge_lora``), runs one dialogue per
forward and prints one JSON line:
the token-weighted mean next-token NLL, the supervised-token count and the dialogue count.
With ``CONVERTED`` (a folder ``xtuner-rope convert pth_to_hf`` saved from ``CHECKPOINT``) it also
loads that folder with plain ``AutoModelForCausalLM.from_pretrained`` and adds how many of its
weights differ from the ones put in above (bit for bit) and the largest difference of its logits
from theirs over every held-out dialogue. The plugin is never imported (checked at the end).
"""

import json
import math
import os
import re
import sys

import torch
from mmengine.config import Config
from xtuner.registry import BUILDER


def module_weights(checkpoint: str) -> dict:
    """The model's weights as the run held them when it saved ``checkpoint``.

    A ``.pth`` file (one process, DDP) holds them in ``state_dict``; a ZeRO-1/2 folder in
    ``mp_rank_00_model_states.pt`` (the module's full tensors). A ZeRO-3 folder has no such
    file (each rank saved its partition): DeepSpeed's own ``zero_to_fp32`` gathers the fp32
    partitions. Not XTuner's ``guess_load_checkpoint``: xtuner 0.2.0 reads them as fp16
    (``xtuner/utils/zero_to_any_dtype.py``: ``DEFAULT_DTYPE = torch.float16``), and this
    reference imports nothing of the plugin, whose compat patch makes it read fp32.
    """
    if os.path.isfile(checkpoint):
        return torch.load(checkpoint, map_location="cpu", weights_only=False)["state_dict"]
    states = os.path.join(checkpoint, "mp_rank_00_model_states.pt")
    if os.path.isfile(states):
        return torch.load(states, map_location="cpu", weights_only=False)["module"]
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    folder, tag = os.path.split(checkpoint.rstrip(os.sep))
    return get_fp32_state_dict_from_zero_checkpoint(folder, tag)  # ZeRO-3: fp32 partitions


# llm.base_model.model.<module>.lora_A[.<adapter>].weight: peft's names in XTuner's state_dict
LORA_KEY = re.compile(
    r"^llm\.base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])(\.\w+)?\.weight$"
)


def merge_lora(llm: torch.nn.Module, state: dict, lora: dict) -> int:
    """Add a LoRA adapter into ``llm``'s base weights: ``W += B @ A * lora_alpha / r``.

    XTuner's ``SupervisedFinetune.state_dict`` of a LoRA model holds only the adapter
    (``llm.base_model.model.<module>.lora_A.default.weight`` ``[r, in]`` and ``lora_B``
    ``[out, r]``). Every key must be one of such a pair of a linear layer of ``llm``
    (``bias="none"``, no rsLoRA, no ``modules_to_save``): anything else fails here. Dropout is a
    training-only op and has no place in the merged weights. Returns the number of layers merged.
    """
    assert lora.get("bias", "none") == "none" and not lora.get("use_rslora"), lora
    scale = lora["lora_alpha"] / lora["r"]
    modules = dict(llm.named_modules())
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        match = LORA_KEY.match(key)
        assert match, f"not a LoRA weight: {key}"
        pairs.setdefault(match["module"], {})[match["ab"]] = value.float()
    with torch.no_grad():
        for name, pair in sorted(pairs.items()):
            module = modules[name]
            module.weight += pair["B"] @ pair["A"] * scale  # [out, r] @ [r, in]
    return len(pairs)


def load_converted(folder: str, llm: torch.nn.Module) -> tuple[torch.nn.Module, int]:
    """A converted Hugging Face folder loaded by plain transformers (fp32, its own remote code)
    and how many of its weights are not ``llm``'s bit for bit (a missing or extra name counts)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        folder, torch_dtype=torch.float32, trust_remote_code=True
    ).eval()
    ours, theirs = llm.state_dict(), hf.state_dict()
    unequal = len(ours.keys() ^ theirs.keys()) + sum(
        not torch.equal(ours[k], theirs[k]) for k in ours.keys() & theirs.keys()
    )
    return hf, unequal


def main(config: str, checkpoint: str, converted: str | None = None) -> dict:
    cfg = Config.fromfile(config)
    dataset_cfg = cfg.val_dataloader.dataset
    dataset_cfg.pack_to_max_length = False
    dataset_cfg.use_varlen_attn = False
    dataset = BUILDER.build(dataset_cfg)
    llm = BUILDER.build(cfg.model.llm).float().eval()
    state = module_weights(checkpoint)
    if cfg.model.get("lora"):  # the adapter alone, on the pretrained weights just loaded
        assert merge_lora(llm, state, cfg.model.lora) > 0
    else:
        missing, unexpected = llm.load_state_dict(
            {k.removeprefix("llm."): v for k, v in state.items()}, strict=True
        )
        assert not missing and not unexpected, (missing, unexpected)
    hf, unequal = load_converted(converted, llm) if converted else (None, None)
    hf_diff = 0.0
    nll, tokens, dialogues = [], 0, 0
    with torch.no_grad():
        for sample in dataset:
            ids = torch.tensor([sample["input_ids"]])
            labels = torch.tensor(sample["labels"])
            logits = llm(input_ids=ids).logits[0].float()  # [s, V]
            if hf is not None:
                hf_logits = hf(input_ids=ids).logits[0].float()  # [s, V]
                hf_diff = max(hf_diff, (hf_logits - logits).abs().max().item())
            target = labels[1:]
            n = int((target != -100).sum())
            if n == 0:
                continue
            loss = torch.nn.functional.cross_entropy(
                logits[:-1], target, ignore_index=-100, reduction="sum"
            )
            nll.append(float(loss.double()))
            tokens += n
            dialogues += 1
    assert not any(name.startswith("xtuner_rope") for name in sys.modules), "plugin imported"
    result = {"loss": math.fsum(nll) / tokens, "tokens": tokens, "dialogues": dialogues}
    if hf is not None:
        result.update(converted_unequal_weights=unequal, converted_logit_diff=hf_diff)
    return result


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:])))
