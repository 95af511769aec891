"""``chunked_causal_lm_loss`` against the live full-logits loss: transformers 4.48's own
``ForCausalLMLoss`` on ``head(hidden)``, forward and backward (hidden states, head weight, bias,
LoRA adapters), packed and padded rows, several chunk sizes."""

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.loss.loss_utils import ForCausalLMLoss
from vocab_tensors import VocabTensors

from xtuner_rope.ops.chunked_loss import (
    chunk_tokens_for,
    chunked_causal_lm_loss,
    chunked_target_logprobs,
    head_kind,
)

B, S, H, V = 3, 29, 16, 53
CUDA = torch.cuda.is_available()


def _labels(b=B, s=S, masked=0.4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, V, (b, s), generator=gen)
    labels[torch.rand(b, s, generator=gen) < masked] = -100
    return labels


def _packed_and_padded():
    """Row 0: three documents packed, each prompt -100; row 1: right padding of -100."""
    labels = _labels(2, S, masked=0.0)
    labels[0, [0, 1, 9, 10, 11, 20]] = -100  # each document's prompt
    labels[1, :4] = -100
    labels[1, 17:] = -100  # padding
    return labels


def _reference(hidden, labels, head, scale=None, n=None):
    logits = head(hidden)
    if scale is not None:
        logits = logits * scale
    return ForCausalLMLoss(logits, labels, V, num_items_in_batch=n)


def _grads(loss, tensors):
    return torch.autograd.grad(loss, tensors)


def _assert_same(got, want, rtol=1e-6, atol=1e-7):
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=rtol, atol=atol)


@pytest.mark.parametrize("chunk", [1, 7, 64, None])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", ["random", "packed_padded"])
def test_linear_head_equals_the_models_loss_fp32(chunk, bias, rows):
    labels = _labels() if rows == "random" else _packed_and_padded()
    head = nn.Linear(H, V, bias=bias)
    hidden = torch.randn(*labels.shape, H, requires_grad=True)
    wrt = [hidden, *head.parameters()]
    want = _reference(hidden, labels, head)
    got = chunked_causal_lm_loss(hidden, labels, head, chunk_tokens=chunk)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    _assert_same(_grads(got, wrt), _grads(want, wrt))


@pytest.mark.parametrize("n", [40, "tensor"])
def test_num_items_in_batch_divides_the_sum(n):
    n = torch.tensor(40) if n == "tensor" else n
    labels, head = _labels(), nn.Linear(H, V)
    hidden = torch.randn(B, S, H, requires_grad=True)
    wrt = [hidden, *head.parameters()]
    want = _reference(hidden, labels, head, n=n)
    got = chunked_causal_lm_loss(hidden, labels, head, num_items_in_batch=n, chunk_tokens=5)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    _assert_same(_grads(got, wrt), _grads(want, wrt))


def test_logit_scale_as_cohere():
    labels, head = _labels(), nn.Linear(H, V, bias=False)
    hidden = torch.randn(B, S, H, requires_grad=True)
    wrt = [hidden, head.weight]
    want = _reference(hidden, labels, head, scale=0.0625)
    got = chunked_causal_lm_loss(hidden, labels, head, logit_scale=0.0625, chunk_tokens=9)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    _assert_same(_grads(got, wrt), _grads(want, wrt))


def test_tied_head_gets_both_gradients():
    """Qwen2.5-0.5B style: the head's weight is the input embedding's."""
    embed, head = nn.Embedding(V, H), nn.Linear(H, V, bias=False)
    head.weight = embed.weight
    ids, labels = torch.randint(0, V, (B, S)), _labels()
    mix = nn.Linear(H, H)

    def loss(chunked):
        hidden = torch.tanh(mix(embed(ids)))  # [b, s, H], through the tied weight
        if chunked:
            return chunked_causal_lm_loss(hidden, labels, head, chunk_tokens=11)
        return _reference(hidden, labels, head)

    wrt = [embed.weight, *mix.parameters()]
    _assert_same(_grads(loss(True), wrt), _grads(loss(False), wrt))


def _lora_head(dropout=0.0):
    model = nn.Sequential()
    model.add_module("output", nn.Linear(H, V, bias=False))
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=["output"])
    peft = get_peft_model(model, config)
    for name, p in peft.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(p, std=0.1)  # B starts at 0: give the test a real adapter
    return peft.base_model.model.output


def test_lora_head_equals_the_models_loss_fp32():
    head = _lora_head()
    assert head_kind(head)[0] == "lora"
    labels = _packed_and_padded()
    hidden = torch.randn(*labels.shape, H, requires_grad=True)
    wrt = [hidden] + [p for p in head.parameters() if p.requires_grad]
    assert len(wrt) == 3  # hidden, lora_A, lora_B (the base weight is frozen)
    want = _reference(hidden, labels, head)
    got = chunked_causal_lm_loss(hidden, labels, head, chunk_tokens=6)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    _assert_same(_grads(got, wrt), _grads(want, wrt))


def test_lora_head_disabled_merged_and_dora():
    """Adapters disabled (DPO's reference: peft's ``disable_adapter()``) give the base head's
    loss; a merged head is named before any chunk; DoRA is not run (``head_kind`` says why)."""
    head, labels = _lora_head(), _labels()
    hidden = torch.randn(B, S, H, requires_grad=True)
    head.enable_adapters(False)
    got = chunked_causal_lm_loss(hidden, labels, head, chunk_tokens=6)
    torch.testing.assert_close(got, _reference(hidden, labels, head.base_layer), rtol=1e-6, atol=0)
    head.enable_adapters(True)
    head.merge()
    with pytest.raises(ValueError, match="adapters are merged into its weight; unmerge them"):
        chunked_causal_lm_loss(hidden, labels, head)
    model = nn.Sequential()
    model.add_module("output", nn.Linear(H, V))
    dora = get_peft_model(model, LoraConfig(r=4, use_dora=True, target_modules=["output"]))
    kind, why = head_kind(dora.base_model.model.output)
    assert kind is None and "DoRA or another LoRA variant" in why


@pytest.mark.parametrize("chunk", [5, 1000])
def test_lora_dropout_masks_are_the_models_own_draw(chunk):
    """With dropout in training, each supervised token's mask is the one peft's forward draws
    over the whole ``[b, s, H]`` input from the same RNG state: the chunked loss and its
    gradients equal the model's own loss on the same draw, and the RNG ends where it does."""
    head = _lora_head(dropout=0.5)
    labels, hidden = _labels(), torch.randn(B, S, H, requires_grad=True)
    wrt = [hidden] + [p for p in head.parameters() if p.requires_grad]
    state = torch.get_rng_state()
    got = chunked_causal_lm_loss(hidden, labels, head, chunk_tokens=chunk)
    after = torch.get_rng_state()
    got_grads = _grads(got, wrt)
    torch.set_rng_state(state)
    want = _reference(hidden, labels, head)
    assert torch.equal(torch.get_rng_state(), after)  # one draw of the same size
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    _assert_same(got_grads, _grads(want, wrt))
    torch.manual_seed(123)  # another draw is another loss: the masks count
    assert abs(float(chunked_causal_lm_loss(hidden, labels, head).detach() - want.detach())) > 1e-4


@pytest.mark.parametrize("lora", [False, True], ids=["linear", "lora"])
def test_bf16_no_further_from_fp32_than_the_full_logits_path(lora):
    """Loss, hidden, weight and bias (LoRA: A and B) gradients, each norm-relative."""
    torch.manual_seed(1)
    labels = _labels(4, 257, masked=0.5)
    head32 = _lora_head() if lora else nn.Linear(H, V, bias=True)
    hidden32 = torch.randn(4, 257, H, requires_grad=True)

    def run(dtype, chunked):
        head = copy.deepcopy(head32).to(dtype)
        hidden = hidden32.detach().to(dtype).requires_grad_(True)
        if chunked:
            loss = chunked_causal_lm_loss(hidden, labels, head, chunk_tokens=100)
        else:
            loss = ForCausalLMLoss(head(hidden), labels, V)
        wrt = [hidden, *(p for p in head.parameters() if p.requires_grad)]
        return [loss.double(), *(g.double() for g in _grads(loss, wrt))]

    ref = run(torch.float32, False)
    full, ours = run(torch.bfloat16, False), run(torch.bfloat16, True)
    assert len(ref) == 4  # loss, hidden, and A and B or weight and bias
    for r, f, o in zip(ref, full, ours):
        err_full, err_ours = (f - r).norm() / r.norm(), (o - r).norm() / r.norm()
        assert err_ours <= err_full * 1.05 + 1e-7, (float(err_ours), float(err_full))


def test_no_supervised_token_gives_zero_and_zero_gradients():
    labels, head = torch.full((B, S), -100), nn.Linear(H, V)
    labels[:, 0] = 3  # the first label of a row is never predicted
    hidden = torch.randn(B, S, H, requires_grad=True)
    wrt = [hidden, *head.parameters()]
    assert torch.isnan(_reference(hidden, labels, head))  # the model's own mean: NaN
    got = chunked_causal_lm_loss(hidden, labels, head)
    assert got.item() == 0.0
    for g in _grads(got, wrt):
        assert g.abs().sum().item() == 0.0


def test_label_outside_the_vocabulary_is_named():
    labels, head = _labels(), nn.Linear(H, V)
    labels[1, 5] = V + 7
    with pytest.raises(ValueError, match=rf"labels\[1, 5\] = {V + 7} is outside the vocabulary"):
        chunked_causal_lm_loss(torch.randn(B, S, H), labels, head)
    labels[1, 5] = -3
    with pytest.raises(ValueError, match=r"labels\[1, 5\] = -3 is outside"):
        chunked_causal_lm_loss(torch.randn(B, S, H), labels, head)


def test_head_on_another_device_is_refused():
    head = nn.Linear(H, V, device="meta")
    with pytest.raises(ValueError, match="'weight' is on meta, the hidden states on cpu"):
        chunked_causal_lm_loss(torch.randn(B, S, H), _labels(), head)


def test_unknown_head_and_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="unsupported head: Sequential is not a plain"):
        chunked_causal_lm_loss(torch.randn(B, S, H), _labels(), nn.Sequential(nn.Linear(H, V)))
    with pytest.raises(ValueError, match=r"expected hidden \[b, s, H\] and labels \[b, s\]"):
        chunked_causal_lm_loss(torch.randn(B, S, H), _labels()[:, :-1], nn.Linear(H, V))


def test_backward_twice_is_refused():
    hidden = torch.randn(B, S, H, requires_grad=True)
    loss = chunked_causal_lm_loss(hidden, _labels(), nn.Linear(H, V))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


def test_chunk_tokens_for_keeps_the_fp32_chunk_within_budget():
    assert chunk_tokens_for(151936, 2**28) * 151936 * 4 <= 2**28
    assert chunk_tokens_for(10**9) == 64  # never below the floor


# ---- chunked_target_logprobs: per-token log-probs, backward by recomputation ----------------


def _targets(b=B, s=S, masked=0.4, seed=3):
    """Already-shifted targets (the id each position predicts), -100 where none is wanted."""
    return _labels(b, s, masked, seed)


def _reference_logprobs(hidden, targets, head, scale=None):
    logits = head(hidden) * (scale if scale is not None else 1)
    logp = logits.float().log_softmax(-1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    return logp * (targets != -100)


def _assert_scaled(got, want, rtol=1e-6):
    """Within ``rtol`` of each tensor's scale: an upstream gradient of N(0, 1) per token gives
    entries of order 1 whose fp32 sums over tokens round at ~1e-7 of the largest."""
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=rtol, atol=rtol * float(w.detach().abs().max()))


@pytest.mark.parametrize("chunk", [1, 7, None])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("scale", [None, 0.0625])
def test_target_logprobs_equal_the_full_logits_for_any_upstream_gradient(chunk, bias, scale):
    targets, head = _targets(), nn.Linear(H, V, bias=bias)
    hidden = torch.randn(B, S, H, requires_grad=True)
    wrt = [hidden, *head.parameters()]
    want = _reference_logprobs(hidden, targets, head, scale)
    got = chunked_target_logprobs(hidden, targets, head, logit_scale=scale, chunk_tokens=chunk)
    _assert_scaled([got], [want])
    upstream = torch.randn(B, S)  # DPO's loss is not linear in the log-probs
    got_grads = torch.autograd.grad(got, wrt, upstream)
    _assert_scaled(got_grads, torch.autograd.grad(want, wrt, upstream))
    assert got_grads[0][targets == -100].abs().sum() == 0


def test_target_logprobs_through_a_lora_head_and_a_tied_weight():
    head = _lora_head()
    targets = _targets()
    hidden = torch.randn(B, S, H, requires_grad=True)
    wrt = [hidden] + [p for p in head.parameters() if p.requires_grad]
    want = _reference_logprobs(hidden, targets, head)
    got = chunked_target_logprobs(hidden, targets, head, chunk_tokens=6)
    _assert_scaled([got], [want])
    upstream = torch.randn(B, S)
    _assert_scaled(
        torch.autograd.grad(got, wrt, upstream), torch.autograd.grad(want, wrt, upstream)
    )

    embed, tied = nn.Embedding(V, H), nn.Linear(H, V, bias=False)
    tied.weight = embed.weight
    ids = torch.randint(0, V, (B, S))

    def summed(chunked):
        hidden = torch.tanh(embed(ids))
        if chunked:
            return chunked_target_logprobs(hidden, targets, tied, chunk_tokens=5).sum()
        return _reference_logprobs(hidden, targets, tied).sum()

    _assert_scaled(_grads(summed(True), [embed.weight]), _grads(summed(False), [embed.weight]))


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="needs CUDA"))],
)
def test_target_logprobs_use_the_models_own_lora_dropout_masks(device):
    """The log-probs' masks are the model's own draw over the whole input, kept for the
    backward (which runs each chunk again and draws nothing): values and gradients equal the
    full logits' on the same draw, and the RNG ends where the model's forward leaves it."""
    rng = torch.cuda if device == "cuda" else torch  # the generator dropout draws from
    head = _lora_head(dropout=0.5).to(device)
    targets = _targets().to(device)
    hidden = torch.randn(B, S, H, device=device, requires_grad=True)
    wrt = [hidden] + [p for p in head.parameters() if p.requires_grad]
    upstream = torch.randn(B, S, device=device)
    state = rng.get_rng_state()
    got = chunked_target_logprobs(hidden, targets, head, chunk_tokens=5)
    after = rng.get_rng_state()
    got_grads = torch.autograd.grad(got, wrt, upstream)
    assert torch.equal(rng.get_rng_state(), after)
    rng.set_rng_state(state)
    want = _reference_logprobs(hidden, targets, head)
    assert torch.equal(rng.get_rng_state(), after)
    _assert_scaled([got], [want])
    _assert_scaled(got_grads, torch.autograd.grad(want, wrt, upstream))


def test_target_logprobs_no_grad_and_nothing_wanted():
    head, hidden = nn.Linear(H, V), torch.randn(B, S, H, requires_grad=True)
    with torch.no_grad():
        got = chunked_target_logprobs(hidden, _targets(), head, chunk_tokens=4)
    assert got.grad_fn is None and got.dtype == torch.float32
    torch.testing.assert_close(got, _reference_logprobs(hidden, _targets(), head).detach())
    none = chunked_target_logprobs(hidden, torch.full((B, S), -100), head)
    assert none.abs().sum() == 0
    assert _grads(none.sum(), [hidden])[0].abs().sum() == 0


def test_target_logprobs_never_build_the_rows_logits():
    targets, head = _targets(masked=0.0), nn.Linear(H, V)
    hidden = torch.randn(B, S, H, requires_grad=True)
    with VocabTensors(V) as seen:
        chunked_target_logprobs(hidden, targets, head, chunk_tokens=7).sum().backward()
    assert 0 < seen.rows <= 7  # chunks of 7 tokens, forward and backward
    with VocabTensors(V) as seen:
        _reference_logprobs(hidden, targets, head).sum().backward()
    assert seen.rows >= B * S  # the counter sees the full path's [b, s, V]


def test_target_logprobs_name_a_bad_target_at_its_position():
    targets = _targets()
    targets[1, 5] = V + 2
    with pytest.raises(ValueError, match=rf"chunked_target_logprobs: labels\[1, 5\] = {V + 2}"):
        chunked_target_logprobs(torch.randn(B, S, H), targets, nn.Linear(H, V))


def test_shifted_labels_are_the_positions_own_targets():
    """Sequence parallel's shards bring labels shifted over the full row: no shift again."""
    hidden = torch.randn(B, S, H, requires_grad=True)
    head, labels = nn.Linear(H, V), _labels()
    want = chunked_causal_lm_loss(hidden, labels, head, chunk_tokens=3)
    want_grads = torch.autograd.grad(want, [hidden, head.weight])
    shifted = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)
    got = chunked_causal_lm_loss(hidden, shifted, head, chunk_tokens=3, shifted=True)
    got_grads = torch.autograd.grad(got, [hidden, head.weight])
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    shifted[1, 2] = V + 5
    with pytest.raises(ValueError, match=rf"labels\[1, 2\] = {V + 5} is outside"):
        chunked_causal_lm_loss(hidden, shifted, head, shifted=True)


class _Shapes(TorchDispatchMode):
    """The shapes of the tensors every aten op inside the block returns."""

    def __init__(self):
        super().__init__()
        self.shapes = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.shapes.add(tuple(t.shape))
        return out


@pytest.mark.parametrize("op", ["loss", "logprobs"])
def test_a_frozen_head_gets_no_weight_gradient_buffer(op):
    """LoRA leaving the head out (XTuner's ``find_all_linear_names`` drops ``lm_head``): no
    ``[V, H]`` gradient is made, and the hidden states' gradient is the full logits'."""
    labels, hidden = _labels(), torch.randn(B, S, H, requires_grad=True)
    chunked = chunked_causal_lm_loss if op == "loss" else chunked_target_logprobs
    reference = _reference if op == "loss" else _reference_logprobs
    for frozen in (False, True):  # trained: the counter sees the buffer
        head = nn.Linear(H, V).requires_grad_(not frozen)
        with _Shapes() as seen:
            got = _grads(chunked(hidden, labels, head, chunk_tokens=7).sum(), [hidden])
        assert ((V, H) in seen.shapes) is not frozen, seen.shapes
        _assert_scaled(got, _grads(reference(hidden, labels, head).sum(), [hidden]))
