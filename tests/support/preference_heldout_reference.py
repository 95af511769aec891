"""The plain held-out DPO figures of a checkpoint: each pair whole and alone, no xtuner-rope.

``python preference_heldout_reference.py CONFIG CHECKPOINT SPLIT`` builds the config's
training pairs with XTuner's own ``build_preference_dataset`` unpacked
(``use_varlen_attn=False``: one pair per sample) from the ``SPLIT`` slice of its data file
(``train[90%:]``: what ``heldout = dict(fraction=0.1)`` holds out), loads the config's LLM twice
with ``from_pretrained`` (unpatched, fp32, eager attention) with the checkpoint's policy
(``llm.``) and reference (``ref_llm.``) weights, runs every response alone and prints one JSON
line: XTuner's DPO ``sigmoid`` loss of each pair alone averaged over pairs, the share of pairs
whose chosen reward beats the rejected one, the mean reward margin and the pair count. The
plugin is never imported (checked at the end).
"""

import json
import math
import sys

import torch
import torch.nn.functional as F
from mmengine.config import Config
from xtuner.registry import BUILDER


def _llm(cfg: Config, state: dict, prefix: str) -> torch.nn.Module:
    llm = BUILDER.build(cfg.model.llm).float().eval()
    llm.load_state_dict({k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)})
    return llm


def _logp(llm: torch.nn.Module, ids: list, labels: list) -> float:
    """Sum of log p over a response's supervised targets, alone, float64."""
    logits = llm(input_ids=torch.tensor([ids])).logits[0, :-1].double()
    return -float(
        F.cross_entropy(logits, torch.tensor(labels[1:]), ignore_index=-100, reduction="sum")
    )


def main(config: str, checkpoint: str, split: str) -> dict:
    cfg = Config.fromfile(config)
    assert cfg.model.get("loss_type", "sigmoid") == "sigmoid", "this reference is DPO sigmoid"
    dataset_cfg = cfg.train_dataloader.dataset
    dataset_cfg.use_varlen_attn = False
    dataset_cfg.dataset.split = split
    pairs = BUILDER.build(dataset_cfg)
    state = torch.load(checkpoint, map_location="cpu", weights_only=False)["state_dict"]
    policy, reference = _llm(cfg, state, "llm."), _llm(cfg, state, "ref_llm.")
    beta, losses, margins, wins = cfg.model.beta, [], [], 0
    with torch.no_grad():
        for pair in pairs:
            logp = {
                (name, side): _logp(llm, pair[f"{side}_ids"], pair[f"{side}_labels"])
                for name, llm in (("policy", policy), ("reference", reference))
                for side in ("chosen", "rejected")
            }
            chosen = beta * (logp["policy", "chosen"] - logp["reference", "chosen"])
            rejected = beta * (logp["policy", "rejected"] - logp["reference", "rejected"])
            losses.append(-F.logsigmoid(torch.tensor(chosen - rejected, dtype=torch.float64)))
            margins.append(chosen - rejected)
            wins += chosen > rejected
    assert not any(name.startswith("xtuner_rope") for name in sys.modules), "plugin imported"
    n = len(margins)
    return {
        "loss": math.fsum(float(x) for x in losses) / n,
        "accuracy": wins / n,
        "margin": math.fsum(margins) / n,
        "pairs": n,
    }


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:4])))
