"""MMEngine hooks: registration, patching through the runner's model, batch checks, MessageHub."""

import copy
from types import SimpleNamespace

import pytest
import torch
from mmengine import MessageHub
from mmengine.registry import FUNCTIONS, HOOKS
from torch import nn
from xtuner.engine.hooks import EvaluateChatHook

from xtuner_rope.collate import rope_collate_fn
from xtuner_rope.hooks import PackedBatchCheckHook, ValidatedRoPEHook, isolates_documents
from xtuner_rope.rope import ValidatedRotaryEmbedding


class _Wrapped(nn.Module):
    """Stands where XTuner's SupervisedFinetune holds the HF model (``.llm``)."""

    def __init__(self, llm):
        super().__init__()
        self.llm = llm


def _runner(model):
    return SimpleNamespace(model=_Wrapped(model))


def _batch(lengths, pack=True, vocab=256):
    items = [dict(input_ids=torch.randint(3, vocab, (n,)).tolist(),
                  labels=torch.randint(3, vocab, (n,)).tolist()) for n in lengths]
    return rope_collate_fn(items, pack=pack, max_length=64)


def test_hooks_and_collate_fn_are_registered_by_name():
    assert isinstance(HOOKS.build(dict(type="ValidatedRoPEHook")), ValidatedRoPEHook)
    assert isinstance(HOOKS.build(dict(type="PackedBatchCheckHook")), PackedBatchCheckHook)
    assert FUNCTIONS.get("rope_collate_fn") is rope_collate_fn


def test_priorities_patch_first_and_reset_before_evaluate_chat():
    from mmengine.hooks.hook import Hook
    from mmengine.runner.priority import get_priority

    evaluate = get_priority(getattr(EvaluateChatHook, "priority", Hook.priority))
    assert ValidatedRoPEHook.priority < PackedBatchCheckHook.priority < 10 < evaluate


def test_validated_rope_hook_patches_model_inside_wrapper(tiny_model):
    runner = _runner(tiny_model)
    assert not isolates_documents(runner.model)
    for stage in ("before_train", "before_val", "before_test"):
        getattr(ValidatedRoPEHook(), stage)(runner)
    assert isolates_documents(runner.model)
    assert all(isinstance(layer.attention.rotary_emb, ValidatedRotaryEmbedding)
               for layer in tiny_model.model.layers)


def test_validated_rope_hook_turns_the_fused_kernel_on(tiny_model):
    from xtuner_rope.rope import use_fused_apply

    runner = _runner(tiny_model)
    before = use_fused_apply(False)
    try:
        ValidatedRoPEHook().before_train(runner)
        assert use_fused_apply(False) is False  # default: eager kernel, nothing switched on
        ids = torch.arange(1, 9)[None]
        eager_logits = tiny_model(input_ids=ids).logits
        ValidatedRoPEHook(fused_apply=True).before_train(runner)
        assert use_fused_apply(True) is True
        torch.testing.assert_close(tiny_model(input_ids=ids).logits, eager_logits,
                                   atol=1e-5, rtol=1e-5)
    finally:
        use_fused_apply(before)


def test_check_hook_publishes_flat_boundaries_and_resets(tiny_model):
    runner = _runner(tiny_model)
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
    tiny_model(**data)  # the HF forward accepts what is left
    hook.after_train_iter(runner, 0, batch)
    assert hub.get_info("cumulative_len_rank_0") is None
    assert hub.get_info("max_seqlen_rank_0") is None


def test_check_hook_refuses_packed_rows_on_an_unpatched_model(tiny_model):
    runner = _runner(tiny_model)
    hook = PackedBatchCheckHook()
    hook.before_train(runner)
    with pytest.raises(ValueError, match=r"row 0 packs \d segments, but the model's attention "
                                         r"does not isolate documents.*ValidatedRoPEHook"):
        hook.before_train_iter(runner, 0, _batch([30, 20, 10]))
    # Padded rows carry an attention mask: fine without the patch.
    hook.before_train_iter(runner, 0, _batch([30, 20], pack=False))
    hook.after_train_iter(runner, 0)


def test_check_hook_names_row_and_field_of_a_bad_label(tiny_model):
    runner = _runner(tiny_model)
    hook = PackedBatchCheckHook()
    hook.before_train(runner)
    batch = _batch([10, 12], pack=False)
    batch["data"]["labels"][1, 4] = 5000  # beyond the 256-token vocabulary
    with pytest.raises(ValueError, match=r"row 1.*labels"):
        hook.before_val_iter(runner, 0, batch)


def test_check_hook_uses_the_validated_rope_limit(tiny_model):
    model = copy.deepcopy(tiny_model)
    runner = _runner(model)
    ValidatedRoPEHook(max_position=16).before_train(runner)
    hook = PackedBatchCheckHook()
    hook.before_train(runner)
    with pytest.raises(ValueError, match="position"):
        hook.before_train_iter(runner, 0, _batch([30, 20]))


def test_check_hook_rejects_non_xtuner_batches(tiny_model):
    with pytest.raises(TypeError, match=r"PackedBatchCheckHook: expected an XTuner batch .*got list"):
        PackedBatchCheckHook().before_train_iter(_runner(tiny_model), 0, [1, 2])
