"""The plain held-out figures of a preference checkpoint: each pair whole and alone, no xtuner-rope.

``python preference_heldout_reference.py CONFIG CHECKPOINT SPLIT`` builds the config's
training pairs with XTuner's own ``build_preference_dataset`` unpacked
(``use_varlen_attn=False``: one pair per sample) from the ``SPLIT`` slice of its data file
(``train[90%:]``: what ``heldout = dict(fraction=0.1)`` holds out), reads the checkpoint's
weights (an MMEngine ``iter_N.pth`` file, or a DeepSpeed ZeRO-1/2 ``iter_N.pth/`` folder: its
``mp_rank_00_model_states.pt`` holds the whole model) and prints one JSON line: the model's loss
of each pair alone averaged over pairs, the share of pairs whose chosen reward beats the
rejected one, the mean reward margin and the pair count. The plugin is never imported
(checked at the end).

- DPO (``sigmoid``): the config's LLM loaded twice with ``from_pretrained`` (unpatched, fp32,
  eager attention) with the policy (``llm.``) and reference (``ref_llm.``) weights, every
  response alone, log-probs summed in float64, XTuner's sigmoid loss written out here.
- ORPO and reward models: XTuner's own model class built from the config unpacked
  (``use_varlen_attn=False``, fp32), the checkpoint loaded into it, and each pair alone
  collated by XTuner's ``preference_collate_fn`` (chosen and rejected in two rows) through the
  model's own ``forward(mode='loss')``: its ``loss`` and its accuracy and margin (ORPO's
  ``reward_acc``/``reward_margin``, a reward model's ``acc`` and score means).
"""

import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from mmengine.config import Config
from xtuner.dataset.collate_fns.preference_collate_fn import preference_collate_fn
from xtuner.registry import BUILDER


def _state(checkpoint: str) -> dict:
    """The model's weights of an MMEngine file or a DeepSpeed ZeRO-1/2 folder."""
    path = Path(checkpoint)
    if path.is_dir():
        state = torch.load(path / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    else:
        state = torch.load(path, map_location="cpu", weights_only=False)["state_dict"]
    return {k.removeprefix("module."): v for k, v in state.items()}


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


def _dpo(cfg: Config, pairs, state: dict) -> tuple[list, list, list]:
    """Per pair: XTuner's DPO sigmoid loss, the reward margin and whether chosen wins."""
    assert cfg.model.get("loss_type", "sigmoid") == "sigmoid", "this reference is DPO sigmoid"
    policy, reference = _llm(cfg, state, "llm."), _llm(cfg, state, "ref_llm.")
    beta, losses, margins = cfg.model.beta, [], []
    for pair in pairs:
        logp = {
            (name, side): _logp(llm, pair[f"{side}_ids"], pair[f"{side}_labels"])
            for name, llm in (("policy", policy), ("reference", reference))
            for side in ("chosen", "rejected")
        }
        chosen = beta * (logp["policy", "chosen"] - logp["reference", "chosen"])
        rejected = beta * (logp["policy", "rejected"] - logp["reference", "rejected"])
        losses.append(float(-F.logsigmoid(torch.tensor(chosen - rejected, dtype=torch.float64))))
        margins.append(chosen - rejected)
    return losses, margins, [m > 0 for m in margins]


def _own_loss(cfg: Config, pairs, state: dict) -> tuple[list, list, list]:
    """Per pair alone through XTuner's ORPO / RewardModel ``forward(mode='loss')``."""
    if not hasattr(torch.cpu, "is_bf16_supported"):
        # xtuner 0.2.0's SupervisedFinetune (ORPO) and RewardModel ask the device for bf16
        # while choosing a flash-attention path; CPU torch has no such query (fp32 here).
        torch.cpu.is_bf16_supported = lambda: False
    cfg.model.use_varlen_attn = False
    model = BUILDER.build(cfg.model).float().eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and not [k for k in missing if "rotary" not in k], (missing, unexpected)
    reward = type(model).__name__ == "RewardModel"
    losses, margins, wins = [], [], []
    for pair in pairs:
        out = model(preference_collate_fn([pair])["data"], mode="loss")
        losses.append(float(out["loss"]))
        if reward:  # one pair: the score means are its two scores
            margins.append(float(out["chosen_score_mean"]) - float(out["rejected_score_mean"]))
            wins.append(float(out["acc"]) == 1.0)
        else:
            margins.append(float(out["reward_margin"]))
            wins.append(float(out["reward_acc"]) == 1.0)
    return losses, margins, wins


def main(config: str, checkpoint: str, split: str) -> dict:
    cfg = Config.fromfile(config)
    dataset_cfg = cfg.train_dataloader.dataset
    dataset_cfg.use_varlen_attn = False
    dataset_cfg.dataset.split = split
    pairs = BUILDER.build(dataset_cfg)
    state = _state(checkpoint)
    kind = cfg.model.type if isinstance(cfg.model.type, str) else cfg.model.type.__name__
    with torch.no_grad():
        losses, margins, wins = (_dpo if kind.endswith("DPO") else _own_loss)(cfg, pairs, state)
    assert not any(name.startswith("xtuner_rope") for name in sys.modules), "plugin imported"
    n = len(margins)
    return {
        "loss": math.fsum(losses) / n,
        "accuracy": sum(wins) / n,
        "margin": math.fsum(margins) / n,
        "pairs": n,
    }


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:4])))
