"""Run by ``torchrun --nproc_per_node 2``: the chunked loss under DeepSpeed ZeRO-3 over gloo.

Each rank holds a different batch of the same tiny model, every parameter partitioned by
ZeRO-3. On that batch the chunked loss (chunks of 5 tokens) and the model's own full-logits loss
(paused chunked loss) run forward and backward through the DeepSpeed engine; the losses and the
full gradients DeepSpeed reduced into the partitions (``safe_get_full_grad``) must agree within
1e-6 relative, for an untied head (InternLM2) and a head tied to the input embeddings (Qwen2).
The head module is called once per forward in both (DeepSpeed gathers its weight once), and
under the chunked loss it returns the loss, never ``[b, s, V]`` logits. Rank 0 writes the
figures to the JSON file named by the first argument; any disagreement exits non-zero.
"""

import json
import sys

import torch
import torch.distributed as dist

VOCAB, CHUNK = 97, 5
CASES = {"internlm2": {}, "qwen2-tied": {"tie_word_embeddings": True}}
CONFIG = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1,
    "zero_allow_untested_optimizer": True,
    "zero_force_ds_cpu_optimizer": False,
    # Threshold 0: every parameter partitioned (by default ZeRO-3 keeps parameters under 1e5
    # elements whole on every rank, the tiny head among them).
    "zero_optimization": {
        "stage": 3,
        "overlap_comm": False,
        "stage3_param_persistence_threshold": 0,
    },
}


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(rank)
    ids = torch.randint(3, VOCAB, (2, 24), generator=gen)
    labels = ids.clone()
    labels[0, : 5 + 3 * rank] = -100  # prompts of different lengths per rank
    labels[1, 15:] = -100
    return ids, labels


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _case(family: str, overrides: dict, rank: int) -> dict:
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from deepspeed.utils import safe_get_full_grad

    from xtuner_rope.demo.tiny import build_tiny
    from xtuner_rope.models.chunked_loss import loss_only, patch_chunked_loss, pause_chunked_loss

    model = build_tiny(family.split("-")[0], VOCAB, seed=0, **overrides).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=CONFIG)
    what = patch_chunked_loss(model, chunk_tokens=CHUNK)
    head = model.get_output_embeddings()
    # Partitioned: outside the head's call each rank holds no element of the weight.
    assert all(p.ds_status == ZeroParamStatus.NOT_AVAILABLE for p in head.parameters())
    assert all(p.data.numel() == 0 for p in head.parameters())
    outputs = []
    head.register_forward_hook(lambda module, args, out: outputs.append(tuple(out.shape)))
    ids, labels = _batch(rank)
    runs = {}
    for name in ("chunked", "full"):
        resume = pause_chunked_loss(model) if name == "full" else (lambda: None)
        outputs.clear()
        with loss_only():
            loss = engine(input_ids=ids, labels=labels).loss
        engine.backward(loss)
        resume()
        assert all(p.data.numel() == 0 for p in head.parameters())  # released again
        grads = {n: safe_get_full_grad(p).clone() for n, p in model.named_parameters()}
        runs[name] = (loss.detach(), grads, list(outputs))
        engine.optimizer.zero_grad()  # micro step 0: the next backward overwrites the partitions
    (loss_c, grads_c, out_c), (loss_f, grads_f, out_f) = runs["chunked"], runs["full"]
    assert out_c == [()] and out_f == [(2, 24, VOCAB)], (out_c, out_f)  # one head call each
    figures = {
        "head": what,
        "loss": [float(loss_c), float(loss_f)],
        "loss_relative": abs(float(loss_c - loss_f)) / abs(float(loss_f)),
        "grad_relative": {n: _relative(grads_c[n], grads_f[n]) for n in grads_f},
    }
    worst = max(figures["grad_relative"].values())
    assert figures["loss_relative"] <= 1e-6 and worst <= 1e-6, figures
    return figures


def main() -> None:
    import xtuner_rope

    xtuner_rope.activate()  # compat: ZeRO-3's gather over gloo waits for every all-gather
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    figures = {family: _case(family, overrides, rank) for family, overrides in CASES.items()}
    if rank == 0:
        with open(sys.argv[1], "w", encoding="utf-8") as f:
            json.dump(figures, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
