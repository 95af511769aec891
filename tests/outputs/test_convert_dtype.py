"""`xtuner-rope convert pth_to_hf --dtype`: the dtype chosen, and what a cast loses, counted.

Small state dicts and a small module; the counts are checked against torch's own cast of each
value (a live reference), not stored numbers. The real conversions of a ZeRO-2 checkpoint are
in tests/integration/test_resume.py (they share its 2-process run).
"""

from __future__ import annotations

import pytest
import torch
from deepspeed_folders import deepspeed_folder

from xtuner_rope.cli import main
from xtuner_rope.outputs.convert_dtype import (
    cast_module,
    describe_cast,
    save_dtype,
    trained_dtype,
)

# fp16: 1e5 and -7e4 overflow (largest finite 65504), 1e-9 flushes (smallest subnormal 6e-8);
# bf16 keeps fp32's range: only fp32 subnormals below bf16's 9.2e-41 flush (1e-44).
VALUES = torch.tensor([1.0, 1e5, -7e4, 1e-9, 0.0, 1e-44, 3e-5, float("inf")])


def _expected(values: torch.Tensor, dtype: torch.dtype) -> tuple[int, int]:
    """Overflowed and flushed values, one value at a time through torch's own cast."""
    overflowed = flushed = 0
    for value in values.tolist():
        cast = torch.tensor([value]).to(dtype).item()
        overflowed += abs(value) != float("inf") and abs(cast) == float("inf")
        flushed += value != 0 and cast == 0
    return overflowed, flushed


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cast_counts_overflow_and_flush_per_tensor(dtype):
    model = torch.nn.Module()
    model.a = torch.nn.Parameter(VALUES.clone())
    model.b = torch.nn.Parameter(torch.ones(3))
    model.register_buffer("ids", torch.arange(4))
    losses = cast_module(model, dtype)
    assert model.a.dtype == dtype and model.ids.dtype == torch.int64  # ints kept
    by_name = {loss.name: loss for loss in losses}
    assert set(by_name) == {"a", "b"}
    a = by_name["a"]
    assert (a.overflowed, a.flushed) == _expected(VALUES, dtype)
    assert (by_name["b"].overflowed, by_name["b"].flushed) == (0, 0)
    if dtype == torch.float16:
        assert (a.overflowed, a.flushed) == (2, 2)  # the live count is not trivially zero


def test_cast_module_in_place_and_report_names_the_tensors():
    model = torch.nn.Linear(4, 2)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1e5, 1.0, 1e-9, 2.0], [0.5, 0.25, 1e-10, 1.0]]))
    model.register_buffer("scale", torch.tensor([1.0]))
    losses = cast_module(model, torch.float16)
    assert model.weight.dtype == model.bias.dtype == model.scale.dtype == torch.float16
    text = describe_cast(losses, torch.float16)
    print(text)
    assert (
        "the cast to fp16 lost values in 1 of 3 tensor(s): 1 overflowed to inf, 2 nonzero" in text
    )
    assert "  weight: 1 overflowed, 2 flushed (of 8)" in text
    assert "bias" not in text
    clean = describe_cast(cast_module(torch.nn.Linear(2, 2), torch.bfloat16), torch.bfloat16)
    assert clean.endswith(
        "cast 2 tensor(s) to bf16: no value overflowed to inf or was flushed to zero."
    )


def test_trained_dtype_reads_the_checkpoint(tmp_path):
    pth = tmp_path / "iter_1.pth"
    bf16 = {"w": torch.ones(2).bfloat16(), "v": torch.ones(1).bfloat16(), "n": torch.ones(1)}
    torch.save({"state_dict": bf16}, pth)  # the most common floating dtype: bf16
    assert trained_dtype(str(pth)) == torch.bfloat16
    deepspeed_folder(tmp_path / "iter_2.pth", world=2, ranks=[0, 1])  # fp32 module
    assert trained_dtype(str(tmp_path / "iter_2.pth")) == torch.float32
    assert save_dtype(None, False, str(pth)) == (
        torch.bfloat16,
        f"the dtype of the trained weights in {pth}; --dtype chooses another",
    )
    assert save_dtype("fp16", False, str(pth))[0] == torch.float16
    assert save_dtype(None, True, str(pth))[0] == torch.float32  # XTuner's --fp32


def test_trained_dtype_of_a_folder_without_model_states_says_what_to_give(tmp_path):
    with pytest.raises(FileNotFoundError, match="give the iter_N.pth that xtuner train wrote"):
        trained_dtype(str(tmp_path))


def test_fp32_with_another_dtype_is_refused():
    with pytest.raises(ValueError, match="--fp32 and --dtype bf16 ask for two dtypes"):
        save_dtype("bf16", True, "unused")


def test_cli_refuses_two_dtypes_and_unknown_ones(tmp_path, capsys):
    pth = tmp_path / "iter_1.pth"
    torch.save({"state_dict": {"w": torch.ones(2)}}, pth)
    args = ["convert", "pth_to_hf", str(tmp_path / "cfg.py"), str(pth), str(tmp_path / "hf")]
    assert main([*args, "--fp32", "--dtype", "fp16"]) == 2
    assert "--fp32 and --dtype fp16 ask for two dtypes: give one" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:
        main([*args, "--dtype", "fp8"])
    assert stop.value.code == 2
    assert "argument --dtype: invalid choice: 'fp8'" in capsys.readouterr().err
