"""The plain held-out loss of a LLaVA checkpoint: each sample whole and alone, no xtuner-rope.

``python llava_heldout_reference.py CONFIG CHECKPOINT HELDOUT_JSON IMAGE_FOLDER`` builds the
config's training ``LLaVADataset`` pointed at the held-out file (XTuner's own tokenization and
image processing), the config's ``LLaVAModel`` with XTuner's classes (its LLM in fp32: CPU),
puts the checkpoint's weights in (the trained LLM and projector; the frozen CLIP tower, and a
pretrain config's frozen LLM, are the pretrained ones), runs each sample alone through XTuner's ``default_collate_fn`` and the model's
own loss (``mode='loss'``: mean cross-entropy over the sample's text labels), and prints one
JSON line: the token-weighted mean NLL, the supervised-token and sample counts. The plugin is
never imported (checked at the end).
"""

import json
import math
import sys

import torch
from mmengine.config import Config
from xtuner.dataset.collate_fns import default_collate_fn
from xtuner.registry import BUILDER


def main(config: str, checkpoint: str, heldout: str, images: str) -> dict:
    if not hasattr(torch.cpu, "is_bf16_supported"):
        # xtuner 0.2.0 LLaVAModel asks the device for bf16 while choosing a flash-attention
        # dtype (unused here: fp32, no flash-attn); CPU torch has no such query. No math changes.
        torch.cpu.is_bf16_supported = lambda: False
    cfg = Config.fromfile(config)
    dataset_cfg = cfg.train_dataloader.dataset
    dataset_cfg.update(data_path=heldout, image_folder=images, offline_processed_text_folder=None)
    dataset = BUILDER.build(dataset_cfg)
    cfg.model.llm.torch_dtype = torch.float32
    model = BUILDER.build(cfg.model).float().eval()
    state = torch.load(checkpoint, map_location="cpu", weights_only=False)["state_dict"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    # XTuner saves the trained parts only: never the frozen CLIP tower, nor a frozen LLM
    # (the pretrain configs train the projector alone).
    frozen = ("visual_encoder.", "llm.") if cfg.model.get("freeze_llm") else ("visual_encoder.",)
    assert not unexpected and all(k.startswith(frozen) for k in missing), (
        unexpected,
        [k for k in missing if not k.startswith(frozen)],
    )
    assert any(k.startswith("projector.") for k in state), "no projector in the checkpoint"
    nll, tokens, samples = [], 0, 0
    with torch.no_grad():
        for item in dataset:
            n = sum(label != -100 for label in item["labels"][1:])
            if n == 0:
                continue
            loss = model(default_collate_fn([item])["data"], mode="loss")["loss"]
            nll.append(float(loss.double()) * n)
            tokens, samples = tokens + n, samples + 1
    assert not any(name.startswith("xtuner_rope") for name in sys.modules), "plugin imported"
    return {"loss": math.fsum(nll) / tokens, "tokens": tokens, "samples": samples}


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:5])))
