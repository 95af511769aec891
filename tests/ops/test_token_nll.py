"""``document_nll`` against a live reference: each document's slice scored alone by
``torch.nn.functional.cross_entropy`` with the usual next-token shift."""

import pytest
import torch
import torch.nn.functional as F

from xtuner_rope.ops.token_nll import document_nll


def _alone(logits, labels, bounds):
    out = []
    for a, e in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        target = labels[a + 1 : e]
        nll = F.cross_entropy(logits[a : e - 1], target, ignore_index=-100, reduction="sum")
        out.append((float(nll), int((target != -100).sum())))
    return out


@pytest.mark.parametrize(
    "bounds", [[0, 13], [0, 1, 13], [0, 5, 6, 13], [0, 4, 9], [0, 2, 3, 7, 11, 13]]
)
def test_each_document_as_alone(bounds):
    s, vocab = 13, 11
    logits, labels = torch.randn(s, vocab), torch.randint(0, vocab, (s,))
    labels[torch.rand(s) < 0.3] = -100
    bounds = torch.tensor(bounds)
    nll, tokens = document_nll(logits, labels, bounds)
    expected = _alone(logits, labels, bounds)
    assert tokens.tolist() == [n for _, n in expected]
    torch.testing.assert_close(nll, torch.tensor([x for x, _ in expected], dtype=torch.float64))


def test_tokens_after_the_last_boundary_count_for_nothing():
    logits, labels = torch.randn(8, 5), torch.randint(0, 5, (8,))
    nll, tokens = document_nll(logits, labels, torch.tensor([0, 3, 6]))
    assert len(nll) == 2 and int(tokens.sum()) == 2 + 2


def test_bad_boundaries_and_shapes_are_named():
    logits, labels = torch.randn(6, 5), torch.zeros(6, dtype=torch.long)
    with pytest.raises(ValueError, match=r"boundaries must rise from 0 to at most 6"):
        document_nll(logits, labels, torch.tensor([0, 4, 4, 6]))
    with pytest.raises(ValueError, match=r"logits must be \[s, V\] or \[s\] with s = 6"):
        document_nll(torch.randn(1, 6, 5), labels, torch.tensor([0, 6]))


@pytest.mark.parametrize("bounds", [[0, 13], [0, 5, 6, 13], [0, 2, 3, 7, 11]])
def test_target_logprobs_give_the_logits_sums(bounds):
    """The chunked path's ``[s]`` log-probs of the row-shifted labels (what the held-out
    ``predict`` returns with ``chunked_loss`` on) instead of the logits."""
    s, vocab = 13, 11
    logits, labels = torch.randn(s, vocab), torch.randint(0, vocab, (s,))
    labels[torch.rand(s) < 0.3] = -100
    targets = torch.cat([labels[1:], torch.tensor([-100])])  # what position t predicts
    logp = logits.log_softmax(-1).gather(1, targets.clamp(min=0)[:, None])[:, 0]
    logp = logp * (targets != -100)
    bounds = torch.tensor(bounds)
    want, got = document_nll(logits, labels, bounds), document_nll(logp, labels, bounds)
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=0)
