"""Shared fixtures: seeded RNG, the tiny InternLM2 and its tokenizer, built in code."""

import copy
import json
import os
import random
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import settings

# Shared helpers (stock_configs, runners, gold ...) live in tests/support: tests in every folder
# import them by name (`from stock_configs import ...`). Put it first, before any test imports.
SUPPORT = Path(__file__).resolve().parent / "support"
if str(SUPPORT) not in sys.path:
    sys.path.insert(0, str(SUPPORT))
# The maintainer's tools outside the wheel (``tools.zoo``, ``tools.sample_data``) import from
# the repository root, whichever way pytest is started (`python -m pytest` adds it, `pytest`
# does not).
ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path:
    sys.path.insert(1, ROOT)

import xtuner_rope  # noqa: E402

xtuner_rope.activate()  # the tests drive the modules directly: patches, registries, findings
from xtuner_rope.demo.tiny import build_tiny_internlm2, iter_dialogue_texts, train_tokenizer  # noqa: E402, I001
from xtuner_rope.ops.rotate import use_fused_apply  # noqa: E402

# Property tests: 100 random examples by default; CI (`CI` set, as in .ci/run) replays a fixed
# derandomized set so a merge is never blocked by a new random draw; HYPOTHESIS_PROFILE=search
# runs 5,000 examples per property to hunt for counterexamples (pin any found with @example).
settings.register_profile("dev", max_examples=100)
settings.register_profile("ci", max_examples=100, derandomize=True)
settings.register_profile("search", max_examples=5000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))

REPO = Path(__file__).resolve().parents[1]
SAMPLE_DATA = REPO / "data" / "short_dialogues.jsonl"


@pytest.fixture(scope="module", autouse=True)
def _no_boundaries_of_another_module():
    """XTuner's ``varlen_attn_args`` hub lives for the whole process: a test module never
    starts with the boundaries another module left published (xdist runs several files in
    one worker, in an order that changes from run to run)."""
    from xtuner_rope.models import channel

    channel.clear()
    yield


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
    return {
        impl: build_tiny_internlm2(256, seed=0, attn_implementation=impl)
        for impl in ("eager", "sdpa")
    }


@pytest.fixture(params=["eager", "sdpa"])
def tiny_model(request, _tiny_models):
    """A fresh copy of the tiny InternLM2 (vocab 256, fp32), per attention implementation."""
    return copy.deepcopy(_tiny_models[request.param])


def _no_compiler_reason():
    """Why torch.compile cannot build the fused RoPE kernel for CPU tensors here, or None."""
    from torch._inductor import cpp_builder  # where inductor itself looks for a C++ compiler

    try:
        cpp_builder.get_cpp_compiler()
    except Exception as error:  # noqa: BLE001 - InvalidCxxCompiler and kin: no compiler at all
        return f"no C++ compiler for torch.compile on CPU ({type(error).__name__})"
    return None


@pytest.fixture
def fused():
    """The fused RoPE kernel on for one test (CPU tensors), then back to the state it was in.

    Skips only where no C++ compiler exists. Fails the test if the kernel fell back to eager
    during it (a failed compile switches it off with a warning), so that "fused equals eager"
    never compares eager with itself; tests add `fused_kernel_calls()` checks of their own.
    """
    reason = _no_compiler_reason()
    if reason:
        pytest.skip(reason)
    assert not torch._dynamo.config.suppress_errors, "dynamo would hide a failed compile"
    before = use_fused_apply(True)
    yield
    assert use_fused_apply(before), "the fused RoPE kernel fell back to eager during the test"


def pytest_collection_modifyitems(config, items):
    """Files of real runs first (``tests/integration``, then any file with a ``slow`` test),
    the rest after, each file's tests in their order.

    ``make test`` hands whole files to two workers (``--dist loadfile
    --no-loadscope-reorder``: without it pytest-xdist hands out the files with the most tests
    first, whatever this order) in this order: the
    long real runs start first and the many short files fill the end, so neither worker waits
    alone on a long file at the end of the suite.
    """
    heavy = {item.path for item in items if item.get_closest_marker("slow")}

    def weight(item) -> int:
        return 0 if "integration" in item.path.parts else 1 if item.path in heavy else 2

    items.sort(key=weight)  # stable: a file's tests stay contiguous
