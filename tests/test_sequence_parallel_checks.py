"""The batch check and the doctor under sequence parallel: XTuner's shard split divisibility,
rows shorter than the SP size, the padding segment, the start-up's heads refusal."""

import pytest
import torch
from runners import tiny_runner
from xtuner.dataset.collate_fns import default_collate_fn

from xtuner_rope import hooks as hooks_module
from xtuner_rope.batch.sequence_parallel import (
    check_sequence_parallel_rows,
    sequence_parallel_padding,
)
from xtuner_rope.collate import rope_collate_fn
from xtuner_rope.hooks import PackedBatchCheckHook


def _items(lengths, vocab=256):
    g = torch.Generator().manual_seed(0)
    return [dict(input_ids=torch.randint(3, vocab, (n,), generator=g).tolist(),
                 labels=torch.randint(3, vocab, (n,), generator=g).tolist()) for n in lengths]


def test_padding_to_a_multiple_of_the_size():
    assert [sequence_parallel_padding(n, 4) for n in (1, 3, 4, 5, 8, 255)] == [3, 1, 0, 3, 0, 1]


def test_xtuner_collated_rows_not_divisible_are_refused_with_the_edit():
    # XTuner's own collate (one process: no SP group, so it does not pad) of 9- and 13-token rows.
    shape = tuple(default_collate_fn(_items([9, 13]))["data"]["input_ids"].shape)
    assert shape == (2, 13)
    with pytest.raises(ValueError, match=r"sequence_parallel_size = 2: batch rows 0\.\.1 are 13 "
                       r"tokens long, not a multiple of 2 \(13 % 2 = 1\); XTuner's "
                       r"split_for_sequence_parallel asserts.*rope_collate_fn\(\.\.\., "
                       r"pad_to_multiple_of=2\)"):
        check_sequence_parallel_rows(shape, 2, pads_itself=False)
    with pytest.raises(ValueError, match=r"are 3 tokens long \(shorter than the 4 shards\)"):
        check_sequence_parallel_rows((1, 3), 4, pads_itself=False)
    check_sequence_parallel_rows(shape, 2, pads_itself=True)  # the plugin's loss pads itself
    check_sequence_parallel_rows(shape, 1, pads_itself=False)  # no sequence parallel


def test_rope_collate_fn_padded_to_the_size_passes():
    batch = rope_collate_fn(_items([9, 13, 5]), pack=True, max_length=64, pad_to_multiple_of=4)
    b, s = batch["data"]["input_ids"].shape
    assert s % 4 == 0
    check_sequence_parallel_rows((b, s), 4, pads_itself=False)


def test_check_hook_refuses_an_indivisible_train_batch_on_an_unpatched_model(tmp_path,
                                                                            monkeypatch):
    runner = tiny_runner(tmp_path)
    hook = PackedBatchCheckHook()
    hook.before_train(runner)  # no ValidatedRoPEHook: XTuner's own SP loss would run
    batch = rope_collate_fn(_items([9, 12]), pack=False)  # [2, 12] padded rows
    hook.before_train_iter(runner, 0, batch)  # one process: no sequence parallel
    monkeypatch.setattr(hooks_module, "sequence_parallel_size", lambda: 5)
    batch = rope_collate_fn(_items([9, 12]), pack=False)
    with pytest.raises(ValueError, match=r"sequence_parallel_size = 5: batch rows 0\.\.1 are 12 "
                       r"tokens long.*pad_to_multiple_of=5"):
        hook.before_train_iter(runner, 0, batch)
    hook.after_train_iter(runner, 0)
