"""Held-out evaluation in a stock config: the data, the config entries, the plain reference.

``write_heldout_data`` writes alpaca-format dialogues that the training data
(``stock_configs.write_alpaca_data``, the first 400 sample dialogues) does not hold, of mixed
lengths; ``with_heldout`` adds MMEngine's entries (``val_dataloader`` like the training one,
``val_evaluator=dict(type=TokenLossMetric)``, ``val_cfg``) to a stock config's text;
``plain_reference`` runs ``heldout_reference.py`` in a fresh process without the plugin;
``logged_heldout`` reads a run's held-out metrics; ``check_image_heldout`` holds a LLaVA or
InternVL run's logged held-out loss against its no-plugin reference script;
``train_two_processes`` runs ``xtuner-rope train`` on 2 CPU processes (opt-in tests:
``BY_HAND``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import stock_configs as sc

REFERENCE = Path(__file__).with_name("heldout_reference.py")
# Held-out runs too slow for CI (minutes on 2 cores) run by hand: XTUNER_ROPE_HELDOUT_BY_HAND=1.
BY_HAND = os.environ.get("XTUNER_ROPE_HELDOUT_BY_HAND") == "1"
HELDOUT_ENTRIES = """
# Held-out evaluation (xtuner-rope issue 39): MMEngine's entries, the training dataset's dict
# pointed at the held-out file.
from mmengine.runner import ValLoop
from xtuner_rope import TokenLossMetric

val_dataloader = dict(
    batch_size=1,
    num_workers=0,
    dataset=dict(
        type=process_hf_dataset,
        dataset=dict(type=load_dataset, path="{path}"),
        tokenizer=tokenizer,
        max_length=max_length,
        dataset_map_fn=alpaca_map_fn,
        template_map_fn=dict(type=template_map_fn_factory, template=prompt_template),
        remove_unused_columns=True,
        shuffle_before_pack=True,
        pack_to_max_length=pack_to_max_length,
        use_varlen_attn=use_varlen_attn,
    ),
    sampler=dict(type=DefaultSampler, shuffle=False),
    collate_fn=dict(type=default_collate_fn, use_varlen_attn=use_varlen_attn),
)
val_evaluator = dict(type=TokenLossMetric)
val_cfg = dict(type=ValLoop)
"""


def write_heldout_data(dst: Path, n: int = 150, skip: int = 400) -> Path:
    """``n`` alpaca dialogues after the first ``skip`` sample dialogues; every third one holds
    all its exchanges in one answer (longer), so the lengths are mixed."""
    rows = []
    for i, (_, users, replies) in enumerate(list(sc._turns(skip + n))[skip:]):
        answer = " ".join(replies) if i % 3 == 0 else replies[0]
        rows.append({"instruction": users[0], "input": "", "output": answer})
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "train.json").write_text(json.dumps(rows), encoding="utf-8")
    return dst


def with_heldout(text: str, heldout: Path) -> str:
    """A stock SFT config's text with the held-out entries after its ``train_dataloader``."""
    return sc.sub_once(
        text,
        r"^(#+\n# +PART 4 +Scheduler & Optimizer)",
        HELDOUT_ENTRIES.format(path=heldout).replace("\\", "\\\\") + "\n" + r"\g<1>",
    )


def plain_reference(config: Path, checkpoint: Path, converted: Path | None = None) -> dict:
    """``{'loss', 'tokens', 'dialogues'}`` of the held-out set through the unpatched model;
    with ``converted`` (a Hugging Face folder converted from ``checkpoint``) also
    ``converted_unequal_weights`` and ``converted_logit_diff`` of that folder loaded by plain
    transformers (``heldout_reference.py``)."""
    extra = [str(converted)] if converted else []
    proc = subprocess.run(
        [sys.executable, str(REFERENCE), str(config), str(checkpoint), *extra],
        capture_output=True,
        text=True,
        timeout=600,
        env=sc.venv_env(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def logged_heldout(work_dir: Path) -> dict[int, dict]:
    """The held-out metrics MMEngine wrote to a run's scalars file, by iteration."""
    (scalars,) = work_dir.glob("*/vis_data/scalars.json")
    rows = [json.loads(line) for line in scalars.read_text().splitlines()]
    return {row["step"]: row for row in rows if "heldout_loss" in row}


def check_image_heldout(
    script: Path, config: Path, work_dir: Path, held: Path, steps: list[int], samples: int
) -> dict:
    """A LLaVA / InternVL run's held-out loss at its last evaluation against ``script`` (a
    fresh process without the plugin: each held-out sample alone, ``iter_<last>.pth``), within
    1e-5 relative, with the same token and sample counts; returns both figures."""
    logged = logged_heldout(work_dir)
    assert sorted(logged) == steps, sorted(logged)
    last = logged[steps[-1]]
    images = held.parent / "images"
    checkpoint = work_dir / f"iter_{steps[-1]}.pth"
    proc = subprocess.run(
        [sys.executable, str(script), str(config), str(checkpoint), str(held), str(images)],
        capture_output=True, text=True, env=sc.venv_env(), cwd=work_dir, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    plain = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"held-out at {steps[-1]}: logged {last['heldout_loss']!r}, plain {plain}")
    assert last["heldout_tokens"] == plain["tokens"]
    assert last["heldout_dialogues"] == plain["samples"] == samples
    assert abs(last["heldout_loss"] - plain["loss"]) <= 1e-5 * plain["loss"]
    assert logged[steps[0]]["heldout_loss"] != last["heldout_loss"]  # each evaluation's own
    return {"logged": last, "plain": plain}


def train_two_processes(config: Path, work_dir: Path, *cfg_options: str) -> str:
    """``NPROC_PER_NODE=2 xtuner-rope train CONFIG --launcher pytorch`` on the CPU; its output
    (the command exits non-zero when a rank fails)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(sc.venv_env(), NPROC_PER_NODE="2", NNODES="1", PORT=str(port))
    cmd = ["xtuner-rope", "train", str(config), "--work-dir", str(work_dir)]
    cmd += ["--launcher", "pytorch", "--cfg-options", *cfg_options]
    proc = subprocess.run(cmd, cwd=sc.REPO, env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return out
