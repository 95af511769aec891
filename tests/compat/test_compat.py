"""Third-party patches: each removes a real failure of the pinned stack, and only where it exists."""

import subprocess
import sys

import pytest
import torch

from xtuner_rope import compat
from xtuner_rope.compat import bitsandbytes_triton, deepspeed_cpu


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_apply_is_idempotent():
    first = compat.apply()
    assert compat.apply() == first
    assert "register_internlm2_auto_classes" in first  # registered by the activation (conftest)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the gap exists on CPU-only machines")
def test_xtuner_device_queries_work_on_cpu():
    """Live XTuner code that crashed with AttributeError on torch.cpu.is_bf16_supported."""
    from transformers import AutoConfig
    from xtuner._lite.modelings.internlm2 import InternLM2Config
    from xtuner.model import SupervisedFinetune
    from xtuner.tools.utils import auto_dtype_of_deepspeed_config
    from xtuner.utils.device import get_torch_device

    assert get_torch_device().is_bf16_supported() is False
    cfg = SupervisedFinetune._prepare_for_flash_attn(
        AutoConfig.for_model("internlm2").to_dict() | {"attn_implementation": "sdpa"},
        InternLM2Config(),
    )
    assert cfg["attn_implementation"] == "sdpa"
    ds = auto_dtype_of_deepspeed_config({"bf16": {"enabled": "auto"}})
    assert ds["bf16"]["enabled"] is False


def test_cpu_bf16_patch_is_needed_without_the_plugin():
    """The gap itself: without xtuner_rope, XTuner's CPU device query raises."""
    if torch.cuda.is_available():
        pytest.skip("XTuner queries torch.cuda on a GPU machine: no gap")
    proc = _python("import torch; torch.cpu.is_bf16_supported()")
    assert proc.returncode != 0 and "is_bf16_supported" in proc.stderr


def test_bitsandbytes_imports_with_the_plugin_where_triton_lacks_ops():
    if not bitsandbytes_triton.triton_lacks_ops():
        pytest.skip("this triton still ships triton.ops: no gap")
    bare = _python("import bitsandbytes")
    assert bare.returncode != 0 and "triton.ops" in bare.stderr
    fixed = _python(
        "import xtuner_rope; xtuner_rope.activate(); import bitsandbytes; from peft import LoraConfig, get_peft_model;"
        "import torch; m = torch.nn.Sequential(torch.nn.Linear(4, 4));"
        "print(type(get_peft_model(m, LoraConfig(r=2, target_modules=['0']))).__name__)"
    )
    assert fixed.returncode == 0, fixed.stderr[-2000:]
    assert fixed.stdout.strip().endswith("PeftModel")


def test_bitsandbytes_imports_after_peft_half_imported_it():
    """`xtuner train` imports peft (which half-imports bitsandbytes) before any plugin code."""
    if not bitsandbytes_triton.triton_lacks_ops():
        pytest.skip("this triton still ships triton.ops: no gap")
    code = (
        "import sys, peft; left = [m for m in sys.modules if m.startswith('bitsandbytes.')];"
        "assert left and 'bitsandbytes' not in sys.modules, left;"
        "import xtuner_rope, torch; xtuner_rope.activate(); from peft import LoraConfig, get_peft_model;"
        "m = torch.nn.Sequential(torch.nn.Linear(4, 4));"
        "print(type(get_peft_model(m, LoraConfig(r=2, target_modules=['0']))).__name__)"
    )
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().endswith("PeftModel")
    # Without the plugin the same order fails: the leftovers make the next import fail again.
    bare = _python(
        code.replace("import xtuner_rope, torch; xtuner_rope.activate()", "import torch")
    )
    assert bare.returncode != 0 and "triton.ops" in bare.stderr


def test_internlm2_is_known_to_the_auto_factories():
    from transformers import AutoConfig
    from xtuner._lite.modelings.internlm2 import InternLM2Config

    assert isinstance(AutoConfig.for_model("internlm2"), InternLM2Config)


class _Handle:
    """An async collective's handle: counts how often it was waited for."""

    def __init__(self):
        self.waits = 0

    def wait(self):
        self.waits += 1
        return True


class _Comm:
    """Stand-in for ``deepspeed.comm``: async gathers return handles, other names pass through."""

    world = 2

    def all_gather_into_tensor(self, out, inp, group=None, async_op=False):
        return _Handle()

    def all_gather(self, outs, inp, group=None, async_op=False):
        return _Handle()


def test_gather_recorder_waits_for_every_gather_started_inside():
    recorder = deepspeed_cpu._GatherHandleRecorder(_Comm())
    assert recorder.world == 2  # everything else is DeepSpeed's own
    before = recorder.all_gather_into_tensor(None, None, async_op=True)
    with recorder.every_gather_waited():
        inside = [recorder.all_gather_into_tensor(None, None, async_op=True) for _ in range(3)]
        inside.append(recorder.all_gather([], None, async_op=True))
        assert all(h.waits == 0 for h in inside)  # launched together, as DeepSpeed does
    assert [h.waits for h in inside] == [1, 1, 1, 1] and before.waits == 0
    after = recorder.all_gather_into_tensor(None, None, async_op=True)
    assert after.waits == 0  # outside a coalesced gather nothing changes


@pytest.mark.skipif(torch.cuda.is_available(), reason="the gap exists on the CPU accelerator")
def test_zero3_gather_patch_applies_where_deepspeed_waits_for_the_last_gather_only():
    import deepspeed.runtime.zero.partition_parameters as zero3

    assert "patch_deepspeed_zero3_cpu_gather" in compat.apply()
    assert isinstance(zero3.dist, deepspeed_cpu._GatherHandleRecorder)
    original = zero3.Init._allgather_params_coalesced.__wrapped__
    assert deepspeed_cpu._waits_only_for_last_gather(original)  # deepspeed 0.19.6: the bug is there

    def fixed(launch_handles):  # the shape of the upstream fix (DeepSpeed PR #8539)
        for handle in launch_handles:
            handle.wait()

    assert not deepspeed_cpu._waits_only_for_last_gather(fixed)
    patched = zero3.Init._allgather_params_coalesced
    assert compat.run_patch(deepspeed_cpu.patch_deepspeed_zero3_cpu_gather)  # the guard: once
    assert zero3.Init._allgather_params_coalesced is patched  # never wrapped twice
