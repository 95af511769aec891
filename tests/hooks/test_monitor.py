"""Packing metrics and the NaN tripwire: pure functions against a per-document loop, the hooks
with MMEngine's real MessageHub / OptimWrapper, and both through a real `xtuner train` run."""

import json
import os
import random
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from mmengine.optim import OptimWrapper
from runners import RecordingHook, tiny_runner
from tiny_recipe import CONFIG, REPO, xtuner_train  # tests/support is on sys.path (conftest)

from xtuner_rope.batch.stats import BatchStats, batch_stats
from xtuner_rope.data.collate import rope_collate_fn
from xtuner_rope.hooks import PackedBatchCheckHook, ValidatedRoPEHook
from xtuner_rope.hooks.monitor import NonFiniteError, NonFiniteTripwireHook, PackingMetricsHook
from xtuner_rope.outputs.replay import build_run_model, load_record

SHORT_RUN = (
    "train_cfg.max_epochs=None",
    "train_cfg.max_iters=20",
    "default_hooks.logger.interval=5",
    "default_hooks.checkpoint.interval=20",
)


def _env():
    return dict(
        os.environ, PATH=f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}"
    )


def _items(n, vocab=50, seed=0, unsupervised=()):
    rng = random.Random(seed)
    items = []
    for _ in range(n):
        length = rng.randint(2, 40)
        ids = [rng.randrange(1, vocab) for _ in range(length)]
        labels = [-100] * (length // 2) + ids[length // 2 :]
        items.append({"input_ids": ids, "labels": labels})
    return items, set(unsupervised)


def _expected(items, unsupervised, data):
    """Per-document loop over the items themselves (not over the batch's boundaries)."""
    lengths = [len(it["input_ids"]) for it in items]
    return BatchStats(
        rows=data["input_ids"].shape[0],
        tokens=data["input_ids"].numel(),
        real_tokens=sum(lengths),
        documents=len(items),
        longest_document=max(lengths),
        max_position=int(data["position_ids"].max()),
        unsupervised_documents=len(unsupervised),
    )


def _unsupervise(batch, items, unsupervised):
    """Mask every label of the chosen items in the collated batch (the collator refuses them)."""
    data = batch["data"]
    for r, cu in enumerate(data["cumulative_len"]):
        for d in range(len(cu) - 1):
            start, end = int(cu[d]), int(cu[d + 1])
            ids = data["input_ids"][r, start:end].tolist()
            for i in unsupervised:
                if items[i]["input_ids"] == ids:
                    data["labels"][r, start:end] = -100
    return data


@pytest.mark.parametrize("pack", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_batch_stats_matches_a_per_document_loop(pack, seed):
    items, unsupervised = _items(11, seed=seed, unsupervised={1, 6})
    batch = rope_collate_fn(items, pack=pack, max_length=64, pad_to_multiple_of=16)
    data = _unsupervise(batch, items, unsupervised)
    assert batch_stats(data) == _expected(items, unsupervised, data)
    if not pack:  # plain rows come with a mask; without positions the mask alone must do
        assert "attention_mask" in data
        no_pos = {k: v for k, v in data.items() if k != "position_ids"}
        got = batch_stats(no_pos)
        assert (got.documents, got.real_tokens, got.unsupervised_documents) == (
            len(items),
            sum(len(it["input_ids"]) for it in items),
            len(unsupervised),
        )


def test_a_document_whose_only_label_is_its_first_token_is_unsupervised():
    data = rope_collate_fn([{"input_ids": [5, 6, 7], "labels": [5, 6, 7]}], return_hf_format=True)
    data["labels"][0, 1:] = -100  # only column 0 left: the causal shift never uses it
    assert batch_stats(data).unsupervised_documents == 1


def test_batch_stats_adds_counts_and_keeps_peaks():
    a = BatchStats(1, 8, 6, 2, 5, 4, 1)
    b = BatchStats(2, 16, 10, 3, 3, 7, 0)
    assert a + b == BatchStats(3, 24, 16, 5, 5, 7, 1)


def test_batch_stats_rejects_bad_shapes():
    ids = torch.ones(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"field 'input_ids': expected a \[b, s\] tensor"):
        batch_stats({"input_ids": ids[0], "labels": ids[0]})
    with pytest.raises(ValueError, match=r"field 'labels': expected shape \[2, 4\]"):
        batch_stats({"input_ids": ids, "labels": ids[:, :3]})


def test_metrics_hook_aggregates_each_logging_window(tmp_path):
    """In a real runner.train() with LoggerHook(interval=2): at each iteration, the hooks after
    the metrics hook read the statistics of the batches of its logging window so far."""
    names = (
        "train/docs_per_row",
        "train/real_token_share",
        "train/longest_doc",
        "train/max_position_id",
        "train/unsupervised_seen",
    )

    def probe(runner, data_batch):
        return (
            batch_stats(data_batch["data"]),
            [runner.message_hub.get_scalar(name).current() for name in names],
        )

    recorder = RecordingHook(probe)
    items = [item for s in range(4) for item in _items(9, seed=s)[0]]  # 4 batches of 9
    runner = tiny_runner(
        tmp_path,
        items=items,
        batch_size=9,
        max_iters=4,
        log_interval=2,
        custom_hooks=[
            dict(type=ValidatedRoPEHook),
            dict(type=PackedBatchCheckHook),
            dict(type=PackingMetricsHook),
            recorder,
        ],
    )
    runner.train()
    stats = [seen for seen, _ in recorder.before]
    assert len(stats) == 4
    for k, (_, scalars) in enumerate(recorder.before):
        window = sum(stats[k - k % 2 : k + 1], BatchStats())
        assert scalars == [
            window.documents / window.rows,
            window.real_tokens / window.tokens,
            window.longest_document,
            window.max_position,
            0,
        ], k


class _SqrtLoss(torch.nn.Module):
    """loss = sum(sqrt(w - w0)): finite (0) at w == w0, but its gradient there is inf."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(3))

    def forward(self, x):
        return {"loss": torch.sqrt(self.w - x).sum()}


def _step(model, wrapper, hook, runner):
    batch = {
        "data": {
            "input_ids": torch.tensor([[1, 2, 3]]),
            "labels": torch.tensor([[-100, 2, 3]]),
            "position_ids": torch.tensor([[0, 1, 2]]),
        }
    }
    hook.before_train_iter(runner, 0, data_batch=batch)
    outputs = model(torch.ones(3))
    wrapper.update_params(outputs["loss"])
    hook.after_train_iter(runner, 0, data_batch=batch, outputs=outputs)


def test_premise_mmengine_clipping_steps_on_nonfinite_gradients():
    """Why the tripwire checks before the step: OptimWrapper's clip with
    error_if_nonfinite=False (the recipe's setting) still steps and poisons the weights."""
    model = _SqrtLoss()
    wrapper = OptimWrapper(
        torch.optim.SGD(model.parameters(), lr=0.1),
        clip_grad=dict(max_norm=1.0, error_if_nonfinite=False),
    )
    wrapper.update_params(model(torch.ones(3))["loss"])
    assert not torch.isfinite(model.w).any()


def test_tripwire_stops_a_nonfinite_grad_norm_before_the_step_and_saves_the_batch(tmp_path):
    model = _SqrtLoss()
    wrapper = OptimWrapper(
        torch.optim.SGD(model.parameters(), lr=0.1),
        clip_grad=dict(max_norm=1.0, error_if_nonfinite=False),
    )
    runner = SimpleNamespace(
        model=model,
        optim_wrapper=wrapper,
        work_dir=str(tmp_path),
        iter=6,
        epoch=0,
        seed=3,
        cfg=SimpleNamespace(filename="cfg.py"),
    )
    hook = NonFiniteTripwireHook()
    hook.before_train(runner)
    with pytest.raises(
        NonFiniteError,
        match=r"iteration 7: non-finite grad_norm \((nan|inf)\); "
        r"training stopped before the optimizer step\. The batch is saved in "
        r".*nonfinite_iter7\.pt.*\n.*python tools/replay_batch\.py .*--config cfg",
    ):
        _step(model, wrapper, hook, runner)
    assert torch.equal(model.w.detach(), torch.ones(3)), "the weights must not have changed"
    record = load_record(tmp_path / "nonfinite_iter7.pt")
    assert (record["iteration"], record["seed"], record["quantity"]) == (7, 3, "grad_norm")
    assert record["nonfinite_grads"] == ["w"] and not record["stepped"]
    assert torch.equal(record["data"]["labels"], torch.tensor([[-100, 2, 3]]))
    saved = torch.load(record["weights"], weights_only=True)
    assert torch.equal(saved["w"], torch.ones(3))
    hook.after_train(runner)


def test_replay_refuses_other_files_and_missing_weights(tmp_path):
    torch.save({"format": "something else"}, tmp_path / "x.pt")
    with pytest.raises(ValueError, match="expected a NonFiniteTripwireHook batch file"):
        load_record(tmp_path / "x.pt")
    with pytest.raises(ValueError, match="names no weights file .* pass --checkpoint"):
        build_run_model("cfg.py", {"weights": None})


def _run_batches(n):
    """The first ``n`` batches the tiny recipe trains on, rebuilt as MMEngine builds them."""
    from mmengine.config import Config
    from mmengine.runner import Runner
    from xtuner.tools.utils import set_model_resource

    cfg = Config.fromfile(str(CONFIG))
    set_model_resource(cfg)
    loader = iter(Runner.build_dataloader(cfg.train_dataloader, seed=cfg.seed))
    return [next(loader)["data"] for _ in range(n)]


def _scalars(work_dir):
    path = next(work_dir.glob("*/vis_data/scalars.json"))
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.slow
def test_packing_metrics_in_a_real_log_match_the_batches(tmp_path):
    proc = xtuner_train(tmp_path, *SHORT_RUN)
    log = next(tmp_path.glob("*/*.log")).read_text()
    lines = [line for line in log.splitlines() if "Iter(train) [" in line]
    assert len(lines) == 4, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name in (
        "docs_per_row",
        "real_token_share",
        "longest_doc",
        "max_position_id",
        "unsupervised_seen",
    ):
        assert all(f" {name}: " in line for line in lines), (name, lines[0])
    batches = [batch_stats(data) for data in _run_batches(20)]
    for record in _scalars(tmp_path):
        k = record["iter"]
        window = sum(batches[k - 5 : k], BatchStats())
        assert record["docs_per_row"] == pytest.approx(window.documents / window.rows)
        assert record["real_token_share"] == pytest.approx(window.real_tokens / window.tokens)
        assert record["longest_doc"] == window.longest_document
        assert record["max_position_id"] == window.max_position
        assert record["unsupervised_seen"] == sum(b.unsupervised_documents for b in batches[:k])


def _poisoned_checkpoint(path, token):
    """The tiny checkpoint with one token's embedding row overflowed to inf."""
    from transformers import AutoModelForCausalLM

    shutil.copytree(REPO / "models" / "tiny-internlm2", path)
    model = AutoModelForCausalLM.from_pretrained(str(path), trust_remote_code=True)
    with torch.no_grad():
        model.get_input_embeddings().weight[token] = float("inf")
    model.save_pretrained(str(path))


@pytest.mark.slow
def test_tripwire_stops_a_real_run_and_the_replay_names_layer_and_document(tmp_path):
    batches = _run_batches(8)
    seen = set().union(*(set(b["input_ids"].unique().tolist()) for b in batches[:4]))
    token = min(set(batches[4]["input_ids"].unique().tolist()) - seen)  # first in iteration 5
    _poisoned_checkpoint(tmp_path / "model", token)
    work = tmp_path / "work"
    proc = xtuner_train(
        work,
        *SHORT_RUN,
        f"model.llm.pretrained_model_name_or_path={tmp_path / 'model'}",
        command="xtuner-rope",
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]  # stopped: not a finished training
    batch_file = work / "nonfinite_iter5.pt"
    assert (
        f"NonFiniteError: NonFiniteTripwireHook: iteration 5: non-finite loss (nan); "
        f"training stopped before the optimizer step. The batch is saved in {batch_file}" in out
    ), out[-3000:]
    command = f"python tools/replay_batch.py {batch_file} --config {CONFIG}"
    assert command in out
    record = load_record(batch_file)
    assert (record["iteration"], record["seed"], record["quantity"]) == (5, 0, "loss")
    for field in ("input_ids", "labels", "position_ids"):
        assert torch.equal(record["data"][field], batches[4][field]), field
    assert all(
        torch.equal(got, want)
        for got, want in zip(record["boundaries"], batches[4]["cumulative_len"])
    )
    # Stopped before the step: every weight is finite except the row we overflowed.
    weights = torch.load(record["weights"], weights_only=True)
    bad = {n for n, t in weights.items() if not torch.isfinite(t).all()}
    assert bad == {"llm.model.tok_embeddings.weight"}
    assert torch.isfinite(weights["llm.model.tok_embeddings.weight"][:token]).all()

    replay = subprocess.run(
        command.split(), cwd=REPO, capture_output=True, text=True, timeout=600, env=_env()
    )
    line = next(x for x in replay.stdout.splitlines() if x.startswith("replay: "))
    where = (record["data"]["input_ids"] == token).nonzero().tolist()
    r, c = where[0]
    cu = record["boundaries"][r].tolist()
    d = max(i for i in range(len(cu) - 1) if cu[i] <= c)
    assert (
        "replay: first non-finite value (inf): forward output of llm.model.tok_embeddings "
        "(Embedding)" in line
    ), line
    assert (
        f"row {r}, document {d}, tokens [{cu[d]}, {cu[d + 1]}), first bad token at column "
        f"{c}" in line
    ), line
    hit = {
        (
            rr,
            max(
                i
                for i in range(len(record["boundaries"][rr]) - 1)
                if record["boundaries"][rr][i] <= cc
            ),
        )
        for rr, cc in where
    }
    assert f"documents hit (row, document): {sorted(hit)}" in line, line


def test_replay_names_the_first_poisoned_layer_and_every_document_it_hits():
    """In process: XTuner's SupervisedFinetune on the tiny checkpoint, one output-projection
    weight overflowed to inf in layer 1; packed rows through the patched attention."""
    from mmengine.config import ConfigDict
    from transformers import AutoModelForCausalLM
    from xtuner.model import SupervisedFinetune

    from xtuner_rope.demo.resources import tiny_checkpoint
    from xtuner_rope.models.internlm2 import patch_internlm2_attention
    from xtuner_rope.ops.packing import flat_cumulative
    from xtuner_rope.outputs.replay import replay

    path = tiny_checkpoint(
        str(REPO / "models" / "tiny-internlm2"),
        data_path=str(REPO / "data" / "short_dialogues.jsonl"),
    )
    model = SupervisedFinetune(
        llm=ConfigDict(
            type=AutoModelForCausalLM.from_pretrained,
            pretrained_model_name_or_path=path,
            trust_remote_code=True,
            attn_implementation="sdpa",
        )
    )
    llm = model.llm
    patch_internlm2_attention(model)
    items, _ = _items(7, vocab=200, seed=4)
    data = rope_collate_fn(items, pack=True, max_length=64, return_hf_format=True)
    cus, s = data.pop("cumulative_len"), data["input_ids"].shape[1]
    data.pop("num_unsupervised")  # PackedBatchCheckHook pops it too: the HF forward rejects it
    record = {
        "data": data,
        "varlen": {"cumulative_len": flat_cumulative(cus, s), "max_seqlen": data.pop("max_seqlen")},
    }
    assert replay(model, record) is None  # healthy weights: finite forward and backward
    with torch.no_grad():
        llm.model.layers[1].attention.wo.weight[0, 0] = float("inf")
    found = replay(model, record)
    assert (found.phase, found.module, found.module_type) == (
        "forward",
        "llm.model.layers.1.attention.wo",
        "Linear",
    )
    # inf times any activation: every segment of every row (padding included) is hit.
    assert found.documents == [(r, d) for r, cu in enumerate(cus) for d in range(len(cu) - 1)]
    assert (found.row, found.document, found.tokens, found.column) == (0, 0, (0, int(cus[0][1])), 0)
