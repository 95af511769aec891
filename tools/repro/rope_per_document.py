"""Issue 31's rows: packed documents against each alone on length-dependent RoPE (tiny models).

Tiny dynamic-NTK Llama (factor 4, ``max_position_embeddings`` 64), InternLM2 with XTuner's
dynamic class (factor 2, 64) or LongRoPE Phi-3 (``original_max_position_embeddings`` 32); each of
the rows [20, 100], [100, 20], [40, 100], [70, 100], [20, 25] packed through the patched model,
each document alone through the unpatched one (its rotary reset to the loaded state first:
upstream's dynamic NTK is stateful). Prints the largest logit difference per row; ``--off``
sets ``per_document = False`` (every document gets its row's frequencies, as upstream).

``--padded``: issue 38's right-padded batches instead, real lengths [40, 100], [70, 100] and
[20, 70] with an ``attention_mask``, each row against itself alone, through the patched model
and through the unpatched one (upstream gives every row the frequencies of the padded length).

Usage:
    python tools/repro/rope_per_document.py llama sdpa [--off] [--padded]
"""

import argparse
import copy

import torch

import xtuner_rope
from xtuner_rope.demo.tiny import build_tiny_hf, build_tiny_internlm2
from xtuner_rope.models.dispatch import patch_model
from xtuner_rope.models.rope_documents import reset_upstream_rotaries, set_per_document_rope

ROWS = ([20, 100], [100, 20], [40, 100], [70, 100], [20, 25])
PADDED = ([40, 100], [70, 100], [20, 70])
LONGROPE = dict(
    type="longrope",
    short_factor=[1.0 + 0.05 * i for i in range(8)],
    long_factor=[1.5 + 0.4 * i for i in range(8)],
)


def build(family: str, attn: str):
    if family == "internlm2":
        scaling = dict(type="dynamic", factor=2.0)
        return build_tiny_internlm2(
            256, attn_implementation=attn, max_position_embeddings=64, rope_scaling=scaling
        )
    if family == "phi3":
        return build_tiny_hf(
            "phi3",
            256,
            attn_implementation=attn,
            max_position_embeddings=128,
            original_max_position_embeddings=32,
            rope_scaling=LONGROPE,
        )
    scaling = dict(rope_type="dynamic", factor=4.0)
    return build_tiny_hf(
        family, 256, attn_implementation=attn, max_position_embeddings=64, rope_scaling=scaling
    )


def main():
    xtuner_rope.activate()  # the modules are driven directly: patches and registries first
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("family", choices=["llama", "qwen2", "mistral", "phi3", "internlm2"])
    parser.add_argument("attn", choices=["eager", "sdpa"])
    parser.add_argument("--off", action="store_true", help="per-document frequencies off")
    parser.add_argument("--padded", action="store_true", help="right-padded batches instead")
    args = parser.parse_args()
    reference = build(args.family, args.attn).float().train()
    patched = copy.deepcopy(reference)
    patch_model(patched)
    set_per_document_rope(patched, not args.off)
    if args.padded:
        return padded(args, reference, patched)
    for row in ROWS:
        gen = torch.Generator().manual_seed(0)
        docs = [torch.randint(3, 256, (n,), generator=gen) for n in row]
        ids = torch.cat(docs)[None]  # [1, s]
        positions = torch.cat([torch.arange(n) for n in row])[None]  # [1, s]
        with torch.no_grad():
            packed = patched(input_ids=ids, position_ids=positions).logits[0]
            worst, start = 0.0, 0
            for doc in docs:
                reset_upstream_rotaries(reference)
                alone = reference(input_ids=doc[None]).logits[0]
                diff = (packed[start : start + len(doc)] - alone).abs().max()
                worst, start = max(worst, float(diff)), start + len(doc)
        print(f"{args.family} {args.attn} row {row}: max |packed - alone| {worst:.3g}")


def padded(args, reference, patched):
    """Each right-padded batch through ``patched`` and through an unpatched copy."""
    unpatched = copy.deepcopy(reference)
    for lengths in PADDED:
        gen = torch.Generator().manual_seed(0)
        s = max(lengths)
        ids = torch.randint(3, 256, (len(lengths), s), generator=gen)  # [b, s]
        mask = (torch.arange(s)[None] < torch.tensor(lengths)[:, None]).long()  # [b, s]
        worst = {"patched": 0.0, "unpatched": 0.0}
        with torch.no_grad():
            reset_upstream_rotaries(unpatched)
            batch = {
                "patched": patched(input_ids=ids, attention_mask=mask).logits,
                "unpatched": unpatched(input_ids=ids, attention_mask=mask).logits,
            }
            for r, n in enumerate(lengths):
                reset_upstream_rotaries(reference)
                alone = reference(input_ids=ids[r : r + 1, :n]).logits[0]
                for name, logits in batch.items():
                    diff = float((logits[r, :n] - alone).abs().max())
                    worst[name] = max(worst[name], diff)
        print(
            f"{args.family} {args.attn} padded rows {lengths}: max |row - alone| "
            f"patched {worst['patched']:.2g}, unpatched {worst['unpatched']:.2g}"
        )


if __name__ == "__main__":
    main()
