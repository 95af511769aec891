"""Held-out evaluation speed: packed rows (xtuner-rope) vs XTuner's padding, one dialogue a row.

The held-out set is the last ``--dialogues`` sample dialogues, tokenized as XTuner does
(internlm2_chat template). Both ways score every supervised token with ``TokenLossMetric``,
as MMEngine's ``ValLoop`` runs it (``val_step`` = the model's forward with the batch, then
``metric.process``):

- packed (what the start-up makes of a packing ``val_dataloader``): ``heldout_process_hf_dataset``
  packs whole dialogues into rows of ``--max-length``, XTuner's
  ``default_collate_fn(use_varlen_attn=True)`` collates one row a batch,
  ``PackedBatchCheckHook`` publishes its boundaries, the patched tiny InternLM2 isolates them;
- padded: ``process_hf_dataset(pack_to_max_length=False)``, ``default_collate_fn`` pads
  ``--pad-batch`` dialogues to the longest of them, the unpatched model (a copy of the same
  seeded init) runs them; each row is one dialogue.

Printed: rows and real-token share of each way, the held-out loss of each (they must agree:
the same dialogues, each whole and alone) and the ratio of real tokens per second, packed over
padded. Passes are interleaved (order alternated) and each way's time is the median over
``--repeats`` passes, so load from other processes hits both alike. No assertion on time:
read the ratio.

Usage:
    python tools/bench/heldout_eval.py [--quick] [--threads 1] [--repeats 5]
"""

import argparse
import copy
import json
import statistics
import time
import types

import torch
from packing import add_data_options, add_timing_options  # tools/bench/packing.py, beside
from tqdm import tqdm

import xtuner_rope
from xtuner_rope.data.heldout_dataset import heldout_process_hf_dataset
from xtuner_rope.demo.resources import tiny_checkpoint
from xtuner_rope.demo.tiny import build_tiny
from xtuner_rope.evaluation.metric import TokenLossMetric
from xtuner_rope.hooks import PackedBatchCheckHook
from xtuner_rope.models.dispatch import patch_model


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_data_options(parser)
    parser.add_argument(
        "--dialogues", type=int, default=240, help="held-out set: the file's last N dialogues"
    )
    parser.add_argument("--max-length", type=int, default=2048, help="packed row capacity")
    parser.add_argument(
        "--pad-batch", type=int, default=16, help="dialogues per padded batch (default_collate_fn)"
    )
    add_timing_options(parser, repeats=5)
    parser.add_argument("--quick", action="store_true", help="80 dialogues, 3 repeats")
    return parser.parse_args()


def build_datasets(args):
    """``(packed, padded, vocab_size)``: the held-out set both ways, through XTuner's builders."""
    import datasets
    from transformers import AutoTokenizer
    from xtuner.dataset import process_hf_dataset
    from xtuner.dataset.map_fns import openai_map_fn, template_map_fn_factory
    from xtuner.utils import PROMPT_TEMPLATE

    datasets.disable_progress_bars()
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint(args.model, data_path=args.data))
    with open(args.data, encoding="utf-8") as f:
        dialogues = [json.loads(line) for line in f if line.strip()][-args.dialogues :]
    common = dict(
        tokenizer=tokenizer,
        max_length=args.max_length,
        dataset_map_fn=openai_map_fn,
        template_map_fn=template_map_fn_factory(template=PROMPT_TEMPLATE.internlm2_chat),
        remove_unused_columns=True,
        map_num_proc=1,
    )
    packed = heldout_process_hf_dataset(
        datasets.Dataset.from_list(dialogues),
        pack_to_max_length=True,
        use_varlen_attn=True,
        shuffle_before_pack=False,
        **common,
    )
    padded = process_hf_dataset(
        dataset=datasets.Dataset.from_list(dialogues), pack_to_max_length=False, **common
    )
    return [packed[i] for i in range(len(packed))], list(padded), len(tokenizer)


def collate(packed_rows, padded_items, pad_batch):
    """XTuner's ``default_collate_fn`` batches: one packed row each, ``pad_batch`` dialogues each."""
    from xtuner.dataset.collate_fns import default_collate_fn

    packed = [default_collate_fn([row], use_varlen_attn=True) for row in packed_rows]
    padded = [
        default_collate_fn(padded_items[i : i + pad_batch])
        for i in range(0, len(padded_items), pad_batch)
    ]
    return packed, padded


class Way:
    """One model and its batches, evaluated as MMEngine's ``ValLoop`` does."""

    def __init__(self, name, model, batches, hook=None):
        self.name, self.model, self.batches, self.hook = name, model.eval(), batches, hook
        self.runner = types.SimpleNamespace(model=model)  # what the hook reads: runner.model
        if hook is not None:
            hook.before_val(self.runner)

    @torch.no_grad()
    def evaluate(self) -> dict:
        """One pass over the held-out set; ``TokenLossMetric``'s figures."""
        metric = TokenLossMetric()
        for i, stored in enumerate(self.batches):
            batch = {"data": dict(stored["data"]), "data_samples": None}  # the hook pops keys
            if self.hook is not None:
                self.hook.before_val_iter(self.runner, i, data_batch=batch)
            logits = self.model(**batch["data"]).logits  # [b, s, V]: SupervisedFinetune.predict
            outputs = [{"logits": row} for row in logits]
            metric.process(batch, outputs)
            if self.hook is not None:
                self.hook.after_val_iter(self.runner, i, data_batch=batch, outputs=outputs)
        return metric.compute_metrics(metric.results)


def time_ways(ways, args):
    """``(seconds, figures)``: each way's median pass time and its last pass's metrics."""
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    for way in ways:  # warm-up pass, untimed
        way.evaluate()
    samples, figures = {w.name: [] for w in ways}, {}
    for r in tqdm(range(args.repeats), desc="timed passes (x2 ways)", leave=False):
        for way in ways if r % 2 == 0 else ways[::-1]:  # alternate which way runs first
            start = clock()
            figures[way.name] = way.evaluate()
            samples[way.name].append(clock() - start)
    return {name: statistics.median(ts) for name, ts in samples.items()}, figures


def main():
    args = parse_args()
    xtuner_rope.activate()  # the modules are driven directly: patches and registries first
    if args.quick:
        args.dialogues, args.repeats = min(args.dialogues, 80), min(args.repeats, 3)
    torch.set_num_threads(args.threads)
    if args.clock == "auto":
        args.clock = "cpu" if args.threads == 1 else "wall"
    start = time.perf_counter()
    packed_rows, padded_items, vocab_size = build_datasets(args)
    packed, padded = collate(packed_rows, padded_items, args.pad_batch)
    base = build_tiny("internlm2", vocab_size, seed=args.seed, attn_implementation="sdpa")
    isolated = copy.deepcopy(base)
    patch_model(isolated)
    ways = [
        Way("packed", isolated, packed, PackedBatchCheckHook()),
        Way("padded", base, padded),
    ]
    seconds, figures = time_ways(ways, args)
    real = sum(len(item["input_ids"]) for item in padded_items)
    share = {w.name: real / sum(b["data"]["input_ids"].numel() for b in w.batches) for w in ways}
    loss = {name: f["heldout_loss"] for name, f in figures.items()}
    tokens = {name: f["heldout_tokens"] for name, f in figures.items()}
    print(
        f"held-out set: {len(padded_items)} dialogues, {real} real tokens | packed: "
        f"{len(packed)} rows <= {args.max_length} (share {100 * share['packed']:.1f}%) | "
        f"padded: {len(padded)} batches of {args.pad_batch} (share "
        f"{100 * share['padded']:.1f}%); tiny InternLM2, fp32 SDPA, {args.threads} thread(s), "
        f"{args.clock} time, median of {args.repeats} interleaved passes"
    )
    print(
        f"held-out loss: packed {loss['packed']:.8f} ({tokens['packed']} tokens) | padded "
        f"{loss['padded']:.8f} ({tokens['padded']} tokens) | relative difference "
        f"{abs(loss['packed'] - loss['padded']) / loss['padded']:.1e}"
    )
    print(
        f"tokens/s: packed {real / seconds['packed']:.0f} | xtuner padded "
        f"{real / seconds['padded']:.0f} -> packed {seconds['padded'] / seconds['packed']:.2f}x "
        f"xtuner padded ({1e3 * seconds['packed']:.0f} ms vs {1e3 * seconds['padded']:.0f} ms "
        "per pass)"
    )
    print(f"(total {time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
