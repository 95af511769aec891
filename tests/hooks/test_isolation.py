"""MMEngine hooks in a real Runner: registration and order, patching through the runner's
model, batch checks, MessageHub."""

import pytest
import torch
from mmengine import MessageHub
from mmengine.registry import FUNCTIONS, HOOKS
from runners import RecordingHook, tiny_runner
from xtuner.engine.hooks import EvaluateChatHook

from xtuner_rope.data.collate import rope_collate_fn
from xtuner_rope.hooks import PackedBatchCheckHook, ValidatedRoPEHook
from xtuner_rope.hooks.monitor import NonFiniteTripwireHook, PackingMetricsHook
from xtuner_rope.models.dispatch import isolates_documents
from xtuner_rope.models.internlm2_rope import ValidatedRotaryEmbedding
from xtuner_rope.ops.rotate import fused_kernel_calls


@pytest.fixture
def runner(tmp_path):
    """A real Runner around the tiny InternLM2 (XTuner's SupervisedFinetune), hooks not run."""
    return tiny_runner(tmp_path)


def _batch(lengths, pack=True, vocab=256):
    items = [
        dict(
            input_ids=torch.randint(3, vocab, (n,)).tolist(),
            labels=torch.randint(3, vocab, (n,)).tolist(),
        )
        for n in lengths
    ]
    return rope_collate_fn(items, pack=pack, max_length=64)


def test_hooks_and_collate_fn_are_registered_by_name():
    assert isinstance(HOOKS.build(dict(type="ValidatedRoPEHook")), ValidatedRoPEHook)
    assert isinstance(HOOKS.build(dict(type="PackedBatchCheckHook")), PackedBatchCheckHook)
    assert FUNCTIONS.get("rope_collate_fn") is rope_collate_fn


def test_runner_orders_the_plugin_hooks_before_every_default_hook(tmp_path):
    # Listed in the wrong order on purpose: the runner sorts them by their priorities.
    runner = tiny_runner(
        tmp_path,
        custom_hooks=[
            dict(type=NonFiniteTripwireHook),
            dict(type=PackingMetricsHook),
            dict(type=PackedBatchCheckHook),
            dict(type=ValidatedRoPEHook),
        ],
    )
    names = [type(h).__name__ for h in runner.hooks]
    assert names[:5] == [
        "ValidatedRoPEHook",
        "PackedBatchCheckHook",
        "NonFiniteTripwireHook",
        "PackingMetricsHook",
        "RuntimeInfoHook",
    ], names
    # EvaluateChatHook (needs a tokenizer to build) would sort after all of them.
    from mmengine.runner.priority import get_priority

    assert max(get_priority(h.priority) for h in runner.hooks[:4]) < get_priority(
        EvaluateChatHook.priority
    )


def test_real_training_iterations_see_the_patched_model_and_published_boundaries(tmp_path):
    """Through runner.train(): at every iteration the hooks after ours find the model patched,
    the boundaries moved from the batch to the MessageHub, and after the step both reset."""
    hub = MessageHub.get_instance("varlen_attn_args")

    def probe(runner, data_batch):
        data = data_batch["data"]
        return (
            isolates_documents(runner.model),
            "cumulative_len" in data,
            hub.get_info("cumulative_len_rank_0") is not None,
        )

    recorder = RecordingHook(probe)
    runner = tiny_runner(
        tmp_path,
        max_iters=3,
        custom_hooks=[dict(type=ValidatedRoPEHook), dict(type=PackedBatchCheckHook), recorder],
    )
    runner.train()
    assert recorder.before == [(True, False, True)] * 3
    assert recorder.after == [(True, False, False)] * 3
    assert torch.isfinite(torch.tensor(runner.message_hub.get_scalar("train/loss").current()))


def test_validated_rope_hook_patches_model_inside_wrapper(runner):
    assert not isolates_documents(runner.model)
    for stage in ("before_train", "before_val", "before_test"):
        getattr(ValidatedRoPEHook(), stage)(runner)
    assert isolates_documents(runner.model)
    assert all(
        isinstance(layer.attention.rotary_emb, ValidatedRotaryEmbedding)
        for layer in runner.model.llm.model.layers
    )


def test_validated_rope_hook_turns_the_fused_kernel_on(runner, fused):
    from xtuner_rope.ops.rope import use_fused_apply

    use_fused_apply(False)
    ValidatedRoPEHook().before_train(runner)
    assert use_fused_apply(False) is False  # default: eager kernel, nothing switched on
    ids = torch.arange(1, 9)[None]
    eager_logits = runner.model.llm(input_ids=ids).logits
    ValidatedRoPEHook(fused_apply=True).before_train(runner)
    assert use_fused_apply(True) is True
    calls = fused_kernel_calls()
    torch.testing.assert_close(
        runner.model.llm(input_ids=ids).logits, eager_logits, atol=1e-5, rtol=1e-5
    )
    assert fused_kernel_calls() > calls  # the compiled kernel ran, not the eager fall-back


def test_check_hook_publishes_flat_boundaries_and_resets(runner):
    ValidatedRoPEHook().before_train(runner)
    hook = PackedBatchCheckHook()
    hook.before_train(runner)
    batch = _batch([30, 20, 25, 10])  # two packed rows of at most 64 tokens
    data = batch["data"]
    b, s = data["input_ids"].shape
    rows = [cu.tolist() for cu in data["cumulative_len"]]
    hook.before_train_iter(runner, 0, batch)
    assert "cumulative_len" not in data and "max_seqlen" not in data
    hub = MessageHub.get_instance("varlen_attn_args")
    flat = hub.get_info("cumulative_len_rank_0")
    expected = [c + r * s for r, row in enumerate(rows) for c in row[:-1]] + [b * s]
    assert flat.tolist() == expected and flat.dtype == torch.int32
    runner.model.llm(**data)  # the HF forward accepts what is left
    hook.after_train_iter(runner, 0, batch)
    assert hub.get_info("cumulative_len_rank_0") is None
    assert hub.get_info("max_seqlen_rank_0") is None


def test_check_hook_refuses_packed_rows_on_an_unpatched_model(runner):
    hook = PackedBatchCheckHook()
    hook.before_train(runner)
    with pytest.raises(
        ValueError,
        match=r"row 0 packs \d segments, but the model's attention "
        r"does not isolate documents.*ValidatedRoPEHook",
    ):
        hook.before_train_iter(runner, 0, _batch([30, 20, 10]))
    # Padded rows carry an attention mask: fine without the patch.
    hook.before_train_iter(runner, 0, _batch([30, 20], pack=False))
    hook.after_train_iter(runner, 0)


def test_check_hook_names_row_and_field_of_a_bad_label(runner):
    hook = PackedBatchCheckHook()
    hook.before_train(runner)
    batch = _batch([10, 12], pack=False)
    batch["data"]["labels"][1, 4] = 5000  # beyond the 1024-token vocabulary
    with pytest.raises(ValueError, match=r"row 1.*labels"):
        hook.before_val_iter(runner, 0, batch)


def test_check_hook_uses_the_validated_rope_limit(runner):
    ValidatedRoPEHook(max_position=16).before_train(runner)
    hook = PackedBatchCheckHook()
    hook.before_train(runner)
    with pytest.raises(ValueError, match="position"):
        hook.before_train_iter(runner, 0, _batch([30, 20]))


def test_check_hook_rejects_non_xtuner_batches(runner):
    with pytest.raises(
        TypeError, match=r"PackedBatchCheckHook: expected an XTuner batch .*got list"
    ):
        PackedBatchCheckHook().before_train_iter(runner, 0, [1, 2])
