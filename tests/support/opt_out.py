"""A real run through the chunked loss against its twin with ``chunked_loss=False`` (issue 57).

The twin has every setting of its partner (config, options, data, seed, processes, DeepSpeed)
and ``--cfg-options chunked_loss=False``: the model's own full-logits loss. The pair must log
which loss ran, and give the same per-iteration losses, held-out losses and final trained
weights within 1e-6 relative (docs/loss.md, "Exact: the proof").
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

OPT_OUT = "chunked_loss=False"  # the --cfg-options entry of the twin
CHUNKED_LINE = "xtuner-rope: chunked loss: "
OWN_LINE = "chunked_loss = False: the model's own loss (full logits) runs"
# Every iteration's own loss in scalars.json (MMEngine logs a mean over a window of 10 otherwise).
EVERY_ITERATION = ("default_hooks.logger.interval=1", "log_processor.window_size=1")
RTOL = 1e-6  # the bound


def assert_logged(chunked_out: str, own_out: str, chunked_line: str = CHUNKED_LINE) -> None:
    """The partner's start-up says the chunked loss runs, the twin's that the model's own does."""
    assert chunked_line in chunked_out and OWN_LINE not in chunked_out, chunked_out[-3000:]
    assert OWN_LINE in own_out and CHUNKED_LINE not in own_out, own_out[-3000:]


def scalars(work_dir: Path) -> list[dict]:
    """The rows of the newest run's ``vis_data/scalars.json`` in ``work_dir`` (rank 0's)."""
    runs = sorted(Path(work_dir).glob("*/vis_data/scalars.json"))
    assert runs, f"no scalars.json under {work_dir}"
    return [json.loads(line) for line in runs[-1].read_text().splitlines() if line.strip()]


def weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The saved weights of an MMEngine ``.pth`` (XTuner's model state: a LoRA model's adapter
    only) or a DeepSpeed folder (ZeRO-1/2: the module; ZeRO-3: DeepSpeed's ``zero_to_fp32``
    gather of the fp32 partitions), in fp32, without DPO's frozen reference model."""
    checkpoint = Path(checkpoint)
    if checkpoint.is_dir() and any(checkpoint.glob("zero_pp_rank_*_model_states.pt")):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint.parent), checkpoint.name)
    elif checkpoint.is_dir():
        path = checkpoint / "mp_rank_00_model_states.pt"
        state = torch.load(path, map_location="cpu", weights_only=False)["module"]
    else:
        state = torch.load(checkpoint, map_location="cpu", weights_only=False)["state_dict"]
    return {
        k.removeprefix("module."): v.float()
        for k, v in state.items()
        if not k.removeprefix("module.").startswith("ref_llm.")
    }


def initial_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The weights a run starts from: a Hugging Face checkpoint folder's, in fp32."""
    from safetensors.torch import load_file

    state = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        state.update(load_file(file))
    for file in sorted(Path(folder).glob("pytorch_model*.bin")):
        state.update(torch.load(file, map_location="cpu", weights_only=True))
    assert state, f"no weights in {folder}"
    return {k: v.float() for k, v in state.items()}


def updates(final: dict, initial: dict) -> dict[str, torch.Tensor]:
    """``final - initial`` for each saved tensor found in ``initial`` under its name less some
    leading parts (XTuner's ``llm.model.x`` is the checkpoint's ``model.x``)."""
    found = {}
    for name, tensor in final.items():
        parts = name.split(".")
        start = next(
            (".".join(parts[i:]) for i in range(len(parts)) if ".".join(parts[i:]) in initial), None
        )
        if start is not None and initial[start].shape == tensor.shape:
            found[name] = tensor - initial[start]
    assert found, "no saved tensor found in the initial weights"
    return found


def relative_norm(got: dict, want: dict) -> float:
    """``|got - want| / |want|`` over all the tensors (as one vector)."""
    assert got.keys() == want.keys() and want, sorted(got.keys() ^ want.keys())[:5]
    diff = sum(float((got[k] - want[k]).double().pow(2).sum()) for k in want) ** 0.5
    return diff / sum(float(want[k].double().pow(2).sum()) for k in want) ** 0.5


def worst_relative(got: list[float], want: list[float]) -> float:
    """The largest ``|got - want| / |want|`` of two equally long lists of figures."""
    assert len(got) == len(want) and want, (got, want)
    return max(abs(g - w) / abs(w) for g, w in zip(got, want))


def compare_runs(
    chunked: Path,
    own: Path,
    checkpoint: str,
    *,
    iters: int,
    heldout: tuple[int, ...] = (),
    loss_atol: float = 0.0,
    start: Path | None = None,
) -> dict:
    """Assert that two finished runs (work dirs) agree: each iteration's loss within 1e-6
    relative (plus ``loss_atol`` where a test states why) and each held-out loss (at
    ``heldout``) within 1e-6 relative, the final weights of ``checkpoint`` (a name under the work
    dirs, e.g. ``iter_8.pth``) within 1e-6 relative norm, and where the run starts from the
    checkpoint folder ``start``, what training changed (final minus initial, the tensors found
    there: a small learning rate makes the weights' own norm hide any difference) within 1e-6
    relative norm; returns the worst figures (printed)."""
    rows = {name: scalars(work) for name, work in (("chunked", chunked), ("own", own))}
    losses = {
        name: {r["iter"]: r["loss"] for r in got if "loss" in r and "iter" in r}
        for name, got in rows.items()
    }
    assert sorted(losses["chunked"]) == sorted(losses["own"]) == list(range(1, iters + 1)), losses
    pairs = [(losses["chunked"][i], losses["own"][i]) for i in range(1, iters + 1)]
    figures = {
        "loss": worst_relative(*zip(*pairs)),
        "loss_abs": max(abs(g - w) for g, w in pairs),
    }
    bad = [(i, g, w) for i, (g, w) in enumerate(pairs, 1) if abs(g - w) > RTOL * abs(w) + loss_atol]
    assert not bad, (bad, figures)
    if heldout:
        held = {
            n: {r["step"]: r["heldout_loss"] for r in got if "heldout_loss" in r}
            for n, got in rows.items()
        }
        assert sorted(held["chunked"]) == sorted(held["own"]) == list(heldout), held
        figures["heldout_loss"] = worst_relative(
            [held["chunked"][s] for s in heldout], [held["own"][s] for s in heldout]
        )
    got, want = weights(chunked / checkpoint), weights(own / checkpoint)
    figures["weights"] = relative_norm(got, want)
    if start is not None:
        initial = initial_weights(start)
        figures["update"] = relative_norm(updates(got, initial), updates(want, initial))
    print(f"chunked vs chunked_loss=False, worst: {figures}")
    assert all(figures[k] <= RTOL for k in ("heldout_loss", "weights", "update") if k in figures)
    return figures
