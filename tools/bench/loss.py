"""The training loss's memory and time: the chunked loss against the model's full-logits loss.

One row of ``--tokens`` tokens, half of its labels supervised (blocks of prompt and response),
hidden ``--hidden``, a head ``nn.Linear(hidden, vocab)`` trained as in full fine-tuning, or
frozen with ``--frozen-head`` (LoRA runs: the base weight never has a gradient), or frozen and
LoRA-adapted with ``--lora-head R`` (peft's ``lora.Linear``, rank R, alpha 16 as XTuner's stock
LoRA configs, which adapt InternLM2's ``output``; dropout off, so that the two losses are the
same numbers: a dropout mask adds ``[rows, hidden]``, small beside the vocabulary). Each variant
runs forward + backward of the loss (gradients of the hidden states and, trained, the head's
weight) ``--repeats`` times in a fresh process (``--variant``, run by ``main`` through
``subprocess``), so one variant's allocations never count against another's:

- ``full``: transformers 4.48's ``ForCausalLMLoss`` on ``head(hidden)``, what the model does;
- ``chunked``: ``xtuner_rope.ops.chunked_loss.chunked_causal_lm_loss`` (``--chunk-bytes``);
- ``liger``: Liger-Kernel's ``LigerFusedLinearCrossEntropyLoss`` on the shifted supervised
  positions (CUDA only: Triton kernels; skipped elsewhere, and where it is not installed);
- ``full-logprobs``: the target log-probs as XTuner 0.2.0's ``DPO`` takes them
  (``_gather_masked_logits``: ``log_softmax`` of the row's fp32 logits gathered at the
  shifted labels, times the mask), with DPO's upstream gradient: the first half of the row is
  the chosen response, the second the rejected one, loss ``-logsigmoid(0.1 * (sum chosen -
  sum rejected))`` (the reference's log-probs, constants under ``no_grad``, left out);
- ``chunked-logprobs``: the same loss on ``chunked_target_logprobs`` (DPO, ORPO, held-out).

Peak memory: on CUDA ``torch.cuda.max_memory_allocated`` over the step minus what was allocated
before it; on the CPU the process's peak resident set (``VmHWM``) after the step minus its
resident set before it. A variant whose estimated need exceeds the memory available is skipped
(said in the output): the full loss of 8,192 x 151,936 fp32 logits needs ~17 GB. Printed: each
variant's seconds (median; wall clock, and the process's CPU time, which other jobs on a busy
machine disturb less), peak and loss, and the ratios to the full-logits baseline against the
goals (memory <= 0.15x, time <= 0.8x). No assertion: read the ratios.

Usage:
    python tools/bench/loss.py [--quick] [--device cpu|cuda] [--dtype fp32|bf16]
        [--tokens 4096 8192] [--vocab 92544 151936] [--hidden 2048] [--variants ...]
        [--frozen-head | --lora-head R] [--chunk-bytes N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

GOALS = {"memory": 0.15, "time": 0.8}
VARIANTS = ("full", "chunked", "liger", "full-logprobs", "chunked-logprobs")
PAIRS = (("chunked", "full"), ("liger", "full"), ("chunked-logprobs", "full-logprobs"))
DPO_BETA = 0.1


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument(
        "--dtype", default=None, choices=("fp32", "bf16"), help="default: fp32 on cpu, bf16 on cuda"
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--vocab", type=int, nargs="+", default=[92544, 151936])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--chunk-bytes", type=int, default=None, help="default: CHUNK_BYTES")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument(
        "--frozen-head", action="store_true", help="the head's weight without a gradient (LoRA)"
    )
    parser.add_argument(
        "--lora-head", type=int, default=0, metavar="R", help="a frozen head with a rank-R LoRA"
    )
    parser.add_argument(
        "--quick", action="store_true", help="one tiny shape (a test of the script)"
    )
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens, args.vocab, args.hidden, args.repeats = [256], [1000], [64][0], 1
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    return args


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def make_inputs(tokens: int, vocab: int, hidden: int, device: str, dtype, frozen: bool, lora=0):
    """hidden ``[1, tokens, hidden]``, labels ``[1, tokens]`` (half -100 in blocks), head
    (``lora``: the rank of a LoRA on the frozen head, 0 for none)."""
    import torch

    torch.manual_seed(0)  # the head's initialisation: the same in every variant's process
    gen = torch.Generator().manual_seed(0)
    labels = torch.randint(0, vocab, (1, tokens), generator=gen)
    block = max(tokens // 16, 1)  # 8 prompts and 8 responses
    prompt = (torch.arange(tokens) // block) % 2 == 0
    labels[0, prompt] = -100
    head = torch.nn.Linear(hidden, vocab, bias=False).to(device, dtype).requires_grad_(not frozen)
    if lora:
        from xtuner_rope.compat.bitsandbytes_triton import patch_bitsandbytes_triton_probe

        patch_bitsandbytes_triton_probe()  # peft imports bitsandbytes (STACK_NOTES: triton.ops)
        from peft import LoraConfig, inject_adapter_in_model

        box = inject_adapter_in_model(  # peft's lora.Linear around the head, as XTuner gets it
            LoraConfig(r=lora, lora_alpha=16, target_modules=["0"]), torch.nn.Sequential(head)
        )
        head = box[0]
        head.base_layer.requires_grad_(False)
        torch.nn.init.normal_(head.lora_B["default"].weight, std=0.02)  # as after some steps
        head = head.to(device, dtype)
    x = torch.randn(1, tokens, hidden, generator=gen).to(device, dtype).requires_grad_(True)
    return x, labels.to(device), head


def dpo_loss(logps):
    """DPO's sigmoid loss of one row's ``[1, s]`` target log-probs (chosen = the first half),
    and their sum (the figure two variants compare: the loss amplifies its rounding)."""
    import torch.nn.functional as F

    chosen, rejected = logps.chunk(2, dim=1)
    return -F.logsigmoid(DPO_BETA * (chosen.sum() - rejected.sum())), logps.sum()


def loss_fn(variant: str, args, vocab: int):
    import torch

    from xtuner_rope.ops.chunked_loss import CHUNK_BYTES, chunk_tokens_for

    chunk = chunk_tokens_for(vocab, args.chunk_bytes or CHUNK_BYTES)
    if variant == "full":
        from transformers.loss.loss_utils import ForCausalLMLoss

        return lambda x, labels, head: ForCausalLMLoss(head(x), labels, vocab)
    if variant == "chunked":
        from xtuner_rope.ops.chunked_loss import chunked_causal_lm_loss

        return lambda x, labels, head: chunked_causal_lm_loss(x, labels, head, chunk_tokens=chunk)
    if variant == "full-logprobs":

        def full_logprobs(x, labels, head):
            targets = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)
            mask = targets != -100
            logits = head(x).float()  # [1, s, V]: the model's output, as DPO reads it
            index = targets.masked_fill(~mask, 0)[..., None]  # [1, s, 1]
            return dpo_loss(logits.log_softmax(-1).gather(2, index)[..., 0] * mask)

        return full_logprobs
    if variant == "chunked-logprobs":
        from xtuner_rope.ops.chunked_loss import chunked_target_logprobs

        def chunked_logprobs(x, labels, head):
            targets = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)
            return dpo_loss(chunked_target_logprobs(x, targets, head, chunk_tokens=chunk))

        return chunked_logprobs
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    liger = LigerFusedLinearCrossEntropyLoss()

    def liger_loss(x, labels, head):
        shift = labels[:, 1:].reshape(-1)
        return liger(head.weight, x[:, :-1].reshape(-1, x.shape[-1]), shift)

    assert torch.cuda.is_available()
    return liger_loss


def run_variant(args) -> dict:
    """One variant in this process: its median seconds, peak bytes over the step, loss."""
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "0")) or torch.get_num_threads())
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    tokens, vocab = args.tokens[0], args.vocab[0]
    fn = loss_fn(args.variant, args, vocab)
    x, labels, head = make_inputs(
        tokens, vocab, args.hidden, args.device, dtype, args.frozen_head, args.lora_head
    )
    cuda = args.device == "cuda"
    seconds, cpu, peak, loss, logps = [], [], None, None, None
    for i in range(args.repeats):
        for p in (x, *head.parameters()):
            p.grad = None
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        else:
            before = _status_kb("VmRSS") * 1024
        start, start_cpu = time.perf_counter(), time.process_time()
        out = fn(x, labels, head)
        out, summed = out if isinstance(out, tuple) else (out, None)
        out.backward()
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
        if i == 0:
            high = torch.cuda.max_memory_allocated() if cuda else _status_kb("VmHWM") * 1024
            peak, loss = high - before, float(out.detach())
            logps = None if summed is None else float(summed.detach())
        del out, summed
    return {
        "seconds": statistics.median(seconds),
        "cpu_seconds": statistics.median(cpu),
        "peak": peak,
        "loss": loss,
        "logps": logps,
        "trained": head.weight.requires_grad,
        "lora": sum(p.numel() for n, p in head.named_parameters() if n.startswith("lora_")),
    }


def estimated_need(variant: str, tokens: int, vocab: int, hidden: int, size: int) -> int:
    """Bytes a variant needs at most (weights, gradients and its vocabulary-sized tensors)."""
    weights = 2 * vocab * hidden * max(size, 4)  # the weight and its (fp32) gradient
    if variant.startswith("full"):
        # logits, their shifted copy (or their log-softmax's gradient) and the log-softmax
        # (measured: 4,357 MiB at 4,096 x 92,544)
        return weights + int(3.2 * tokens * vocab * 4)
    return weights + 2**30


def available_bytes(device: str) -> int:
    if device == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info()
        return free
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def spawn(args, variant: str, tokens: int, vocab: int) -> dict:
    """Run one variant in a fresh Python process; its result, or ``{"skipped": why}``."""
    argv = [sys.executable, __file__, "--variant", variant, "--device", args.device]
    argv += ["--dtype", args.dtype, "--tokens", str(tokens), "--vocab", str(vocab)]
    argv += ["--hidden", str(args.hidden), "--repeats", str(args.repeats)]
    if args.chunk_bytes:
        argv += ["--chunk-bytes", str(args.chunk_bytes)]
    if args.frozen_head:
        argv.append("--frozen-head")
    if args.lora_head:
        argv += ["--lora-head", str(args.lora_head)]
    # If memory runs out anyway, the kernel's OOM killer takes this process first.
    proc = subprocess.run(
        argv, capture_output=True, text=True, preexec_fn=_oom_first if os.name == "posix" else None
    )
    if proc.returncode != 0:
        return {"skipped": f"failed ({proc.returncode}): {proc.stderr.strip()[-300:]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _oom_first() -> None:
    try:
        Path("/proc/self/oom_score_adj").write_text("1000")
    except OSError:
        pass


def liger_skip(device: str, lora: int = 0) -> str | None:
    if lora:
        return "Liger-Kernel's fused linear cross-entropy takes a plain weight, not a LoRA head"
    if device != "cuda":
        return "Liger-Kernel's fused linear cross-entropy runs Triton kernels: CUDA only"
    try:
        import liger_kernel  # noqa: F401
    except ImportError:
        return "liger-kernel is not installed"
    return None


def _fmt(result: dict) -> str:
    if "skipped" in result:
        return f"skipped: {result['skipped']}"
    seconds = f"{result['seconds']:.3f} s (CPU {result['cpu_seconds']:.3f} s)"
    return f"{seconds}, peak {result['peak'] / 2**20:,.0f} MiB, loss {result['loss']:.6f}"


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.variant:
        print(json.dumps(run_variant(args)))
        return {}
    size = 4 if args.dtype == "fp32" else 2
    results = {}
    for tokens in args.tokens:
        for vocab in args.vocab:
            shape = f"{tokens} tokens x {vocab} vocabulary, hidden {args.hidden}, {args.dtype} on {args.device}"
            head = "frozen" if args.frozen_head else "trained"
            head = f"frozen with a rank-{args.lora_head} LoRA" if args.lora_head else head
            print(f"== {shape} (half supervised, the head {head})")
            row = {}
            for variant in args.variants:
                need = estimated_need(variant, tokens, vocab, args.hidden, size)
                have = available_bytes(args.device)
                why = liger_skip(args.device, args.lora_head) if variant == "liger" else None
                if why is None and need > 0.8 * have:
                    why = f"needs ~{need / 2**30:.1f} GiB, {have / 2**30:.1f} GiB available"
                row[variant] = {"skipped": why} if why else spawn(args, variant, tokens, vocab)
                print(f"  {variant:16s} {_fmt(row[variant])}", flush=True)
            frozen = args.frozen_head or args.lora_head
            report_ratios(row, grad_bytes=0 if frozen else vocab * args.hidden * 4)
            results[(tokens, vocab)] = row
    return results


def report_ratios(row: dict, grad_bytes: int) -> None:
    """Ratios of each variant to its full-logits baseline (``PAIRS``); ``grad_bytes``: the
    head's fp32 gradient (0: frozen), which the chunked loss holds from its forward on (the
    full path allocates it after its peak), and what the variant holds beyond it (the memory
    that grows with the row: the gradient is the head's size, held until the optimizer step by
    every trainer)."""
    for ours, base in PAIRS:
        got, full = (row.get(v, {"skipped": "not asked"}) for v in (ours, base))
        if "skipped" in got:
            continue
        if "skipped" in full:
            print(f"  {ours}: the baseline {base} did not run")
            continue
        if grad_bytes and ours != "liger":
            rest = got["peak"] - grad_bytes  # the chunk, the hidden states' gradient: the row's
            print(
                f"  the head's fp32 gradient alone: {grad_bytes / 2**20:,.0f} MiB = "
                f"{grad_bytes / full['peak']:.3f}x the {base} peak; {ours} beyond it: "
                f"{rest / 2**20:,.0f} MiB = {rest / full['peak']:.3f}x"
            )
        memory, speed = got["peak"] / full["peak"], got["seconds"] / full["seconds"]
        cpu = got["cpu_seconds"] / full["cpu_seconds"]
        agree = f"loss agrees within {_relative(got, full, 'loss'):.1e}"
        if got.get("logps") is not None:
            agree += f", summed log-probs within {_relative(got, full, 'logps'):.1e}"
        print(
            f"  {ours} / {base}: memory {memory:.3f}x (goal <= {GOALS['memory']}x), time "
            f"{speed:.3f}x (goal <= {GOALS['time']}x; CPU time {cpu:.3f}x), {agree}"
        )


def _relative(got: dict, want: dict, key: str) -> float:
    return abs(got[key] - want[key]) / abs(want[key])


if __name__ == "__main__":
    main()
