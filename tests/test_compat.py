"""Third-party patches: each removes a real failure of the pinned stack, and only where it exists."""

import subprocess
import sys

import pytest
import torch

from xtuner_rope import compat


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_apply_is_idempotent():
    first = compat.apply()
    assert compat.apply() == first
    assert "register_internlm2_auto_classes" in first  # registered by `import xtuner_rope`


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
        InternLM2Config())
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
    if not compat._triton_lacks_ops():
        pytest.skip("this triton still ships triton.ops: no gap")
    bare = _python("import bitsandbytes")
    assert bare.returncode != 0 and "triton.ops" in bare.stderr
    fixed = _python("import xtuner_rope, bitsandbytes; from peft import LoraConfig, get_peft_model;"
                    "import torch; m = torch.nn.Sequential(torch.nn.Linear(4, 4));"
                    "print(type(get_peft_model(m, LoraConfig(r=2, target_modules=['0']))).__name__)")
    assert fixed.returncode == 0, fixed.stderr[-2000:]
    assert fixed.stdout.strip().endswith("PeftModel")


def test_bitsandbytes_imports_after_peft_half_imported_it():
    """`xtuner train` imports peft (which half-imports bitsandbytes) before any plugin code."""
    if not compat._triton_lacks_ops():
        pytest.skip("this triton still ships triton.ops: no gap")
    code = ("import sys, peft; left = [m for m in sys.modules if m.startswith('bitsandbytes.')];"
            "assert left and 'bitsandbytes' not in sys.modules, left;"
            "import xtuner_rope, torch; from peft import LoraConfig, get_peft_model;"
            "m = torch.nn.Sequential(torch.nn.Linear(4, 4));"
            "print(type(get_peft_model(m, LoraConfig(r=2, target_modules=['0']))).__name__)")
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().endswith("PeftModel")
    # Without the plugin the same order fails: the leftovers make the next import fail again.
    bare = _python(code.replace("import xtuner_rope, torch", "import torch"))
    assert bare.returncode != 0 and "triton.ops" in bare.stderr


def test_internlm2_is_known_to_the_auto_factories():
    from transformers import AutoConfig
    from xtuner._lite.modelings.internlm2 import InternLM2Config

    assert isinstance(AutoConfig.for_model("internlm2"), InternLM2Config)
