"""Shared fixtures: seeded RNG, the tiny InternLM2 and its tokenizer, built in code."""

import copy
import json
import os
import random
from pathlib import Path

import pytest
import torch
from hypothesis import settings

import xtuner_rope  # noqa: F401  (applies compat: Auto registration, CPU patches)
from xtuner_rope.demo.tiny import build_tiny_internlm2, iter_dialogue_texts, train_tokenizer

# Property tests: 100 random examples by default; CI (`CI` set, as in .ci/run) replays a fixed
# derandomized set so a merge is never blocked by a new random draw; HYPOTHESIS_PROFILE=search
# runs 5,000 examples per property to hunt for counterexamples (pin any found with @example).
settings.register_profile("dev", max_examples=100)
settings.register_profile("ci", max_examples=100, derandomize=True)
settings.register_profile("search", max_examples=5000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))

REPO = Path(__file__).resolve().parents[1]
SAMPLE_DATA = REPO / "data" / "short_dialogues.jsonl"


@pytest.fixture(autouse=True)
def _seed():
    random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def sample_dialogues():
    """The first 200 sample dialogues, as OpenAI-messages dicts."""
    with open(SAMPLE_DATA, encoding="utf-8") as f:
        return [json.loads(line) for line, _ in zip(f, range(200))]


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """The tiny model's tokenizer, trained on the sample dialogues (about a second)."""
    return train_tokenizer(iter_dialogue_texts(SAMPLE_DATA), vocab_size=1024)


@pytest.fixture(scope="session")
def _tiny_models():
    return {impl: build_tiny_internlm2(256, seed=0, attn_implementation=impl)
            for impl in ("eager", "sdpa")}


@pytest.fixture(params=["eager", "sdpa"])
def tiny_model(request, _tiny_models):
    """A fresh copy of the tiny InternLM2 (vocab 256, fp32), per attention implementation."""
    return copy.deepcopy(_tiny_models[request.param])
