"""Run by ``torchrun --nproc_per_node 2``: the chunked loss under DeepSpeed over gloo.

Each rank holds a different batch of the same tiny model. Under ZeRO-3 (every parameter
partitioned) the chunked loss (chunks of 5 tokens) and the model's own full-logits loss (paused
chunked loss) run forward and backward through the engine; the losses, the last hidden states'
gradients and the full gradients DeepSpeed reduced into the partitions (``safe_get_full_grad``)
agree within 1e-6 relative, for an untied head (InternLM2), a tied one (Qwen2) and a LoRA head
(peft on ``output`` and ``wqkv``). So do the target log-probs of DPO/ORPO (``target_logprobs_only``)
and their gradients under a random upstream gradient, and with LoRA the reference's (the
adapters disabled, no grad). Each head parameter is all-gathered as often as the full-logits
path gathers it (once for the forward, once for the backward), never once per chunk; the head
module returns the loss, never ``[b, s, V]`` logits. In bf16 (ZeRO-3, and ZeRO-2 for the untied
head) the chunked loss is no further from the fp32 full-logits reference than the full-logits
loss in bf16 (norm-relative error of the loss, hidden and head gradients, all gradients).
Rank 0 writes the figures to the JSON file named by the first argument; a failure exits
non-zero.
"""

import collections
import json
import sys

import torch
import torch.distributed as dist

VOCAB, CHUNK = 97, 5
STAGE3 = {
    "stage": 3,
    "overlap_comm": False,
    "stage3_param_persistence_threshold": 0,
    "stage3_prefetch_bucket_size": 0,
    "stage3_max_reuse_distance": 0,
}
# Threshold 0: every parameter partitioned (by default ZeRO-3 keeps parameters under 1e5
# elements whole on every rank, the tiny head among them).
CASES = {
    "internlm2": ("internlm2", {}, False),
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True}, False),
    "internlm2-lora": ("internlm2", {}, True),
}
BF16 = [("internlm2", STAGE3), ("internlm2-lora", STAGE3), ("internlm2", {"stage": 2})]


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(rank)
    ids = torch.randint(3, VOCAB, (2, 24), generator=gen)
    labels = ids.clone()
    labels[0, : 5 + 3 * rank] = -100  # prompts of different lengths per rank
    labels[1, 15:] = -100
    return ids, labels


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _model(case: str):
    from peft import LoraConfig, get_peft_model

    from xtuner_rope.demo.tiny import build_tiny

    family, overrides, lora = CASES[case]
    model = build_tiny(family, VOCAB, seed=0, **overrides).train()
    if not lora:
        return model
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["wqkv", "output"])
    model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():  # B starts at 0: a real adapter (policy != reference)
        if "lora_" in name:  # A from this generator too: the bf16 runs rebuild the same model
            p.data.normal_(0, 0.05, generator=gen)
    return model


def _engine(model, zero: dict, bf16: bool = False):
    import deepspeed

    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "zero_optimization": zero,
        "bf16": {"enabled": bf16},
    }
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(trainable, lr=0.0)
    return deepspeed.initialize(model=model, optimizer=optimizer, config=config)[0]


class _Probe:
    """What one step shows: the head's outputs, the hidden states' gradient, the all-gathers of
    each parameter (ZeRO-3: every parameter's ``all_gather_coalesced`` counted)."""

    def __init__(self, model):
        from xtuner_rope.models.chunked_loss import causal_lm

        self.head = causal_lm(model).get_output_embeddings()
        self.outputs, self.hidden, self.gathers = [], [], collections.Counter()
        self.head.register_forward_hook(lambda m, a, out: self.outputs.append(tuple(out.shape)))
        decoder = causal_lm(model).get_decoder()
        decoder.register_forward_hook(lambda m, a, out: self._keep(out.last_hidden_state))
        for p in model.parameters():
            if hasattr(p, "ds_id"):  # ZeRO-3: the module hooks' gathers, and a read's (one)
                p.all_gather_coalesced = self._counted(p.all_gather_coalesced)
                p.all_gather = self._counted(p.all_gather, p)

    def _keep(self, hidden: torch.Tensor) -> None:
        if hidden.requires_grad:
            hidden.register_hook(lambda g: self.hidden.append(g.detach().clone()))

    def _counted(self, gather, param=None):
        def counted(*args, **kwargs):
            if param is not None:
                self.gathers[id(param)] += 1
                return gather(*args, **kwargs)
            params = list(args[0])
            self.gathers.update(id(p) for p in params)
            return gather(params, *args[1:], **kwargs)

        return counted

    def clear(self) -> None:
        self.outputs.clear()
        self.hidden.clear()
        self.gathers.clear()

    def head_gathers(self) -> list[int]:
        return [self.gathers[id(p)] for p in self.head.parameters()]


def _step(engine, model, probe, chunked: bool, logprobs: bool, rank: int) -> dict:
    """One forward and backward of this rank's batch: the SFT loss, or (``logprobs``) the sum of
    the target log-probs weighted by a random upstream gradient, as DPO's loss is not linear."""
    from deepspeed.utils import safe_get_full_grad

    from xtuner_rope.models.chunked_loss import (
        loss_only,
        pause_chunked_loss,
        shifted_targets,
        target_logprobs_only,
    )

    ids, labels = _batch(rank)
    targets = shifted_targets(labels)
    resume = (lambda: None) if chunked else pause_chunked_loss(model)
    probe.clear()
    out = {}
    if logprobs:
        with target_logprobs_only():
            logp = _logprobs(engine(input_ids=ids, labels=targets).logits, targets)
            if hasattr(model, "disable_adapter"):  # LoRA DPO's reference: no adapter, no grad
                with model.disable_adapter(), torch.no_grad():
                    out["reference"] = _logprobs(
                        engine(input_ids=ids, labels=targets).logits, targets
                    )
        upstream = torch.randn(logp.shape, generator=torch.Generator().manual_seed(rank))
        out["logprobs"], loss = logp.detach(), (logp * upstream).sum()
    else:
        with loss_only():
            loss = engine(input_ids=ids, labels=labels).loss
        out["loss"] = loss.detach().reshape(1)
    engine.backward(loss)
    resume()
    if hasattr(next(probe.head.parameters()), "ds_id"):  # ZeRO-3: released again
        assert all(p.data.numel() == 0 for p in probe.head.parameters())
    out["hidden"] = probe.hidden[0]
    grads = {
        n: safe_get_full_grad(p).clone() for n, p in model.named_parameters() if p.requires_grad
    }
    engine.optimizer.zero_grad()  # micro step 0: the next backward overwrites the partitions
    return {
        "values": out,
        "grads": grads,
        "outputs": list(probe.outputs),
        "gathers": probe.head_gathers(),
    }


def _logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``[b, s]`` target log-probs from the chunked ``[b, s, 1]`` or the full ``[b, s, V]``."""
    if logits.shape[-1] == 1:
        return logits[..., 0]
    keep = targets != -100
    picked = logits.float().log_softmax(-1).gather(-1, targets.clamp_min(0)[..., None])[..., 0]
    return picked * keep


def _fp32_case(case: str, rank: int) -> tuple[dict, dict]:
    """The fp32 ZeRO-3 proof of ``case``; returns its figures and the full-logits SFT step (the
    bf16 runs' reference)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    from xtuner_rope.models.chunked_loss import patch_chunked_loss

    model = _model(case)
    engine = _engine(model, STAGE3)
    what = patch_chunked_loss(model, chunk_tokens=CHUNK)
    probe = _Probe(model)
    # Partitioned: outside the head's call each rank holds no element of its parameters.
    assert all(p.ds_status == ZeroParamStatus.NOT_AVAILABLE for p in probe.head.parameters())
    assert all(p.data.numel() == 0 for p in probe.head.parameters())
    figures, full_sft = {"head": what}, None
    for kind in ("sft", "logprobs"):
        runs = {c: _step(engine, model, probe, c, kind == "logprobs", rank) for c in (True, False)}
        got, want = runs[True], runs[False]
        if kind == "sft":
            full_sft = want
        # One head call per forward (the policy's, the reference's); the chunked one returns
        # the loss or the [b, s] log-probs, never [b, s, V] logits.
        calls = len(want["outputs"])
        assert want["outputs"] == [(2, 24, VOCAB)] * calls, want["outputs"]
        assert got["outputs"] == [(2, 24) if kind == "logprobs" else ()] * calls, got["outputs"]
        # The chunks (4+ per forward) gather nothing more: each head parameter as often as the
        # full path gathers it or less (no prefetch, no reuse: STAGE3), once per forward and
        # once for the backward (the embedding's calls too where tied, peft's own extra reads).
        assert all(g <= w for g, w in zip(got["gathers"], want["gathers"])), runs
        figures[kind] = {
            "values": {k: _relative(v, want["values"][k]) for k, v in got["values"].items()},
            "grads": {n: _relative(g, want["grads"][n]) for n, g in got["grads"].items()},
            "gathers [chunked, full]": [got["gathers"], want["gathers"]],
        }
        worst = max([*figures[kind]["values"].values(), *figures[kind]["grads"].values()])
        assert worst <= 1e-6, figures
    return figures, full_sft


def _error(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.double(), ref.double()
    return float((got - ref).norm() / ref.norm())


def _bf16_case(case: str, zero: dict, reference: dict, rank: int) -> dict:
    """The chunked and the full-logits SFT step in bf16 against the fp32 full-logits step."""
    from xtuner_rope.models.chunked_loss import patch_chunked_loss

    model = _model(case)
    engine = _engine(model, zero, bf16=True)
    patch_chunked_loss(model, chunk_tokens=CHUNK)
    probe = _Probe(model)
    runs = {c: _step(engine, model, probe, c, False, rank) for c in (True, False)}
    # The chunked path ran: the head builds no logits (ZeRO-2: not even called).
    chunked_calls = [()] if zero["stage"] == 3 else []
    assert runs[True]["outputs"] == chunked_calls, runs[True]["outputs"]
    assert runs[False]["outputs"] == [(2, 24, VOCAB)], runs[False]["outputs"]
    head = [n for n, p in model.named_parameters() if p.requires_grad and "output" in n]

    def tensors(run: dict) -> dict:
        grads = run["grads"]
        flat = {
            k: torch.cat([grads[n].flatten().double() for n in names])
            for k, names in (("head gradients", head), ("all gradients", grads))
        }
        return {**run["values"], **{n: grads[n] for n in head}, **flat}

    ref, ours, full = (tensors(r) for r in (reference, runs[True], runs[False]))
    errors = {k: [_error(ours[k], ref[k]), _error(full[k], ref[k])] for k in ref}
    # The claim on the loss, the hidden states, the head's gradient (LoRA: A and B as one) and
    # all gradients; single small tensors are recorded (their errors are mostly the shared
    # bf16 forward's: measured LoRA B 6.9e-3 vs 6.5e-3, A 6.5e-3 vs 7.5e-3).
    for name in ("loss", "hidden", "head gradients", "all gradients"):
        err_ours, err_full = errors[name]
        assert err_ours <= err_full * 1.05 + 1e-7, (name, errors)
    return {"errors [chunked, full]": errors}


def main() -> None:
    import xtuner_rope

    xtuner_rope.activate()  # compat: ZeRO-3's gather over gloo waits for every all-gather
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    figures, references = {}, {}
    for case in CASES:
        figures[case], references[case] = _fp32_case(case, rank)
    for case, zero in BF16:
        key = f"{case} bf16 zero{zero['stage']}"
        figures[key] = _bf16_case(case, zero, references[case], rank)
    if rank == 0:
        with open(sys.argv[1], "w", encoding="utf-8") as f:
            json.dump(figures, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
