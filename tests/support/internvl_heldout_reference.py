"""The plain held-out loss of an InternVL checkpoint: each sample whole and alone, no xtuner-rope.

``python internvl_heldout_reference.py CONFIG CHECKPOINT HELDOUT_JSON IMAGE_FOLDER`` builds the
config's training ``InternVL_V1_5_Dataset`` pointed at the held-out file (XTuner's own
templating, tiling and image tokens), loads the config's InternVL checkpoint with its own remote
code (fp32; the LLM's attention eager, as flash-attn does not run on this CPU), puts the run's
weights in (the trained LLM and ``mlp1``; the frozen vision tower is the checkpoint's), runs each
sample alone through XTuner's ``default_collate_fn`` and XTuner's ``InternVL_V1_5.forward``
(the model's own loss: mean cross-entropy over the sample's text labels) in a one-process gloo
group (XTuner asks for the rank at every step), and prints one JSON line: the token-weighted
mean NLL, the supervised-token and sample counts. The plugin is never imported (checked at the
end).
"""

import json
import math
import socket
import sys

import torch
from mmengine.config import Config
from torch import nn
from transformers import AutoConfig, AutoModel, AutoTokenizer
from xtuner.dataset.collate_fns import default_collate_fn
from xtuner.model.internvl import InternVL_V1_5
from xtuner.registry import BUILDER


def _model(path: str, checkpoint: str) -> InternVL_V1_5:
    config = AutoConfig.from_pretrained(path, trust_remote_code=True)
    if config.llm_config.model_type == "internlm2":
        config.llm_config.attn_implementation = "eager"
    else:
        config.llm_config._attn_implementation = "eager"
    chat = AutoModel.from_pretrained(
        path, config=config, torch_dtype=torch.float32, trust_remote_code=True
    )
    chat.img_context_token_id = AutoTokenizer.from_pretrained(
        path, trust_remote_code=True
    ).convert_tokens_to_ids("<IMG_CONTEXT>")
    model = InternVL_V1_5.__new__(InternVL_V1_5)  # XTuner's forward, without its hard-coded load
    nn.Module.__init__(model)
    model.model, model._count = chat, 0
    state = torch.load(checkpoint, map_location="cpu", weights_only=False)["state_dict"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(k.startswith("model.vision_model.") for k in missing), (
        unexpected,
        [k for k in missing if not k.startswith("model.vision_model.")],
    )
    return model.eval()


def main(config: str, checkpoint: str, heldout: str, images: str) -> dict:
    cfg = Config.fromfile(config)
    dataset_cfg = cfg.train_dataloader.dataset
    dataset_cfg.update(data_paths=[heldout], image_folders=[images], repeat_times=[1])
    dataset = BUILDER.build(dataset_cfg)
    model = _model(cfg.model.model_path, checkpoint)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1
    )
    nll, tokens, samples = [], 0, 0
    with torch.no_grad():
        for i in range(len(dataset)):
            item = dataset[i]
            n = int((torch.as_tensor(item["labels"])[1:] != -100).sum())
            if n == 0:
                continue
            loss = model(default_collate_fn([item])["data"], mode="loss")["loss"]
            nll.append(float(loss.double()) * n)
            tokens, samples = tokens + n, samples + 1
    torch.distributed.destroy_process_group()
    assert not any(name.startswith("xtuner_rope") for name in sys.modules), "plugin imported"
    return {"loss": math.fsum(nll) / tokens, "tokens": tokens, "samples": samples}


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:5])))
