"""The chunked loss under DeepSpeed ZeRO-3 on 2 CPU processes equals the full-logits loss.

One ``torchrun`` of ``tests/support/chunked_loss_zero3.py`` (15-35 s here): each rank's batch
through the chunked loss and through the model's own loss, the same engine and parameters, every
one partitioned (``stage3_param_persistence_threshold: 0``: by default the tiny models' heads would
stay whole on every rank, as in ``test_multiprocess.py``'s run); the losses and the gradients DeepSpeed reduced into the partitions agree within
1e-6 relative for an untied head (InternLM2) and a tied one (Qwen2), and the head module runs
once per forward (its weight gathered once, not once per chunk). The 12-iteration ZeRO-3
training run of ``test_multiprocess.py`` (chunked, against one process) is the long proof.
"""

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import stock_configs as sc

SCRIPT = Path(__file__).resolve().parents[1] / "support" / "chunked_loss_zero3.py"

pytestmark = pytest.mark.slow


def test_chunked_loss_equals_full_logits_under_zero3(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "figures.json"
    torchrun = Path(sys.executable).parent / "torchrun"
    cmd = [str(torchrun), "--nproc_per_node", "2", "--master_port", str(port), str(SCRIPT)]
    env = dict(sc.venv_env(), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [*cmd, str(out)], cwd=sc.REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    figures = json.loads(out.read_text())
    assert sorted(figures) == ["internlm2", "qwen2-tied"]
    assert "tied to the input embeddings" in figures["qwen2-tied"]["head"]
    for family, fig in figures.items():
        worst = max(fig["grad_relative"].values())
        print(f"{family}: loss {fig['loss_relative']:.2e}, gradients {worst:.2e} (relative)")
        assert fig["loss_relative"] <= 1e-6 and worst <= 1e-6, fig
        assert len(fig["grad_relative"]) > 10  # every parameter, not the head alone
