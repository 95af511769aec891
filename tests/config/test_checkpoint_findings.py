"""Checkpoints the start-up cannot serve end in its message before a weight loads.

Two cases a new user meets with XTuner's stock configs: a checkpoint whose ``config.json``
cannot be read (a hub id offline: Baichuan2, MiniCPM3 ... on a machine without the hub; a
cluster path; a directory without ``config.json``), and a checkpoint of a family xtuner-rope
does not serve that carries its own modeling code (``auto_map``). Both are refused by the
start-up (``enable_xtuner_rope``) and by ``xtuner-rope doctor`` with the same finding; through
the real launcher the run stops before the remote code is imported (so before any weight).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import stock_configs as sc
import torch
from mmengine.config import Config
from remote_code import MODEL_TYPE, MODELING_IMPORTED, save_remote_code_checkpoint
from tiny_recipe import CONFIG, xtuner_train

from xtuner_rope.cli import main
from xtuner_rope.config import startup
from xtuner_rope.config.checkpoint_findings import checkpoint_config_findings
from xtuner_rope.config.families import model_family_findings
from xtuner_rope.config.findings import ConfigConflict
from xtuner_rope.models.checkpoint_config import read_checkpoint_config

SETTING = "model.llm.pretrained_model_name_or_path"
HUB_ID = "baichuan-inc/Baichuan2-7B-Base"  # XTuner's stock baichuan2_7b_base_* configs
REMOTE_REFUSAL = (
    f"{MODEL_TYPE} cannot be served by xtuner-rope: xtuner-rope has no integration for it (its "
    "modeling code is the checkpoint's own remote code: "
    "modeling_remote_llm.RemoteLLMForCausalLM)"
)
OFFLINE = (
    f"'{HUB_ID}': its config.json cannot be read: no such local directory, and as a hub id it is "
    "not in the local Hugging Face cache while offline mode is on"
)


@pytest.fixture(scope="module")
def remote_checkpoint(tmp_path_factory) -> Path:
    return save_remote_code_checkpoint(
        tmp_path_factory.mktemp("remote") / "remote-llm", sc.ensure_tiny_model()
    )


@pytest.fixture
def offline_hub(tmp_path, monkeypatch) -> dict[str, str]:
    """No hub and an empty Hugging Face cache, here and in child processes (as if set before
    the hub client and transformers were imported, which read these at import)."""
    import transformers.utils.hub
    from huggingface_hub import constants

    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "empty-hf-cache")}
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", env["HF_HUB_CACHE"])
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(transformers.utils.hub, "_is_offline_mode", True)
    return env


def recipe(tmp_path: Path, checkpoint: str) -> Path:
    """The tiny recipe turned on with the README's one edit, training ``checkpoint``."""
    text = sc.sub_once(
        CONFIG.read_text(),
        r"^pretrained_model_name_or_path = .*$",
        f"pretrained_model_name_or_path = {checkpoint!r}",
    )
    text = sc.sub_once(
        text, r"^model_resource = .*$", "model_resource = dict(fn=enable_xtuner_rope)"
    )
    path = tmp_path / "recipe.py"
    path.write_text("from xtuner_rope import enable_xtuner_rope\n" + text)
    return path


def refusal(config: Path) -> str:
    with pytest.raises(ConfigConflict) as err:
        startup.prepare_config(Config.fromfile(str(config)))
    return str(err.value)


def doctor_says(config: Path, out: Path, capsys) -> str:
    """``xtuner-rope doctor CONFIG``'s output; it must exit 1."""
    capsys.readouterr()
    assert main(["doctor", str(config), "--out", str(out)]) == 1
    return capsys.readouterr().out


def test_the_remote_code_checkpoint_is_a_real_model(remote_checkpoint):
    """Positive control: transformers loads and runs it through its own modeling code."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(remote_checkpoint), trust_remote_code=True)
    assert type(model).__module__.endswith("modeling_remote_llm")
    ids = torch.randint(0, 1024, (2, 9))
    assert torch.isfinite(model(input_ids=ids, labels=ids).loss)


def test_unserved_remote_code_family_is_refused_and_the_doctor_agrees(
    remote_checkpoint, tmp_path, capsys
):
    config = recipe(tmp_path, str(remote_checkpoint))
    message = refusal(config)
    assert f"1. {SETTING}: {remote_checkpoint}/config.json (model_type '{MODEL_TYPE}'" in message
    assert REMOTE_REFUSAL in message
    assert "\n  -> use a checkpoint of a served family" in message
    said = doctor_says(config, tmp_path / "doctor", capsys)
    assert REMOTE_REFUSAL in said and SETTING in said


def test_served_checkpoints_with_remote_code_are_not_refused(tmp_path):
    """InternLM2's hub remote code is served: the new rules leave it alone."""
    remote = sc.tiny_with_remote_code(tmp_path / "tiny-internlm2-remote")
    assert "auto_map" in json.loads((Path(remote) / "config.json").read_text())
    cfg = Config.fromfile(str(recipe(tmp_path, str(remote))))
    assert [f for f in startup.inspect_config(cfg) if f.fix is None] == []


UNREADABLE = {  # id -> (make the path under tmp_path, problem, advice)
    "directory without config.json": (
        lambda tmp: str(tmp),
        r"the directory .* has no config\.json \(not a checkpoint\)",
        r"set pretrained_model_name_or_path in PART 1 of the config to a Hugging Face "
        r"checkpoint directory",
    ),
    "cluster path": (
        lambda tmp: "/mnt/petrelfs/share_data/models/Baichuan2-7B-Base",
        r"no such directory \(/mnt/petrelfs/share_data/models/Baichuan2-7B-Base\), and not a "
        r"hub id \(org/name\)",
        r"to a Hugging Face checkpoint directory",
    ),
    "not JSON": (
        lambda tmp: (tmp.joinpath("config.json").write_text("{model_type: llama"), str(tmp))[1],
        r"config\.json is not valid JSON",
        r"to a Hugging Face checkpoint directory",
    ),
    "hub id offline": (
        lambda tmp: HUB_ID,
        OFFLINE.replace("(", r"\(").replace(")", r"\)").replace(".", r"\."),
        rf"as a hub id, download it where the hub can be reached \(`huggingface-cli download "
        rf"{HUB_ID} --local-dir <dir>`\)",
    ),
}


@pytest.mark.parametrize("case", UNREADABLE, ids=list(UNREADABLE))
def test_unreadable_config_json_is_refused_with_what_to_do(case, tmp_path, offline_hub):
    make, problem, advice = UNREADABLE[case]
    (tmp_path / "ckpt").mkdir()
    config = recipe(tmp_path, make(tmp_path / "ckpt"))
    findings = checkpoint_config_findings(Config.fromfile(str(config)))
    assert [f.setting for f in findings] == [SETTING]
    message = refusal(config)
    assert "1 setting(s)" in message, message
    assert message.count(SETTING) == 1
    assert re.search(problem, message), message
    assert re.search(rf"\n  -> .*{advice}", message), message


def test_offline_hub_id_doctor_agrees(tmp_path, offline_hub, capsys):
    said = doctor_says(recipe(tmp_path, HUB_ID), tmp_path / "doctor", capsys)
    assert f"{SETTING}: {OFFLINE}" in said
    # At once, as the run: not after a failed build of the data from the same checkpoint.
    assert "could not build the data" not in said


def test_reader_reads_local_and_cached_checkpoints(tmp_path, offline_hub):
    local = read_checkpoint_config(str(sc.ensure_tiny_model()))
    assert local.problem == "" and local.get("model_type") == "internlm2" and not local.hub
    assert read_checkpoint_config(None) is None and read_checkpoint_config("") is None
    # A hub id in the local cache is read offline, from the cache (as from_pretrained reads it).
    snapshot = Path(offline_hub["HF_HUB_CACHE"]) / "models--org--cached" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    refs = snapshot.parents[1] / "refs"
    refs.mkdir()
    (refs / "main").write_text("0" * 40)
    cached = read_checkpoint_config("org/cached")
    assert cached.hub and cached.get("model_type") == "qwen2", cached


@pytest.mark.slow
def test_xtuner_rope_train_stops_before_the_remote_code_loads(remote_checkpoint, tmp_path):
    """The real launcher: status 1, our message, the checkpoint's modeling code never ran."""
    work = tmp_path / "work"
    proc = xtuner_train(
        work, config=recipe(tmp_path, str(remote_checkpoint)), command="xtuner-rope"
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert "ConfigConflict: xtuner-rope: 1 setting(s)" in out, out[-3000:]
    assert REMOTE_REFUSAL in out
    assert MODELING_IMPORTED not in out  # the refusal came before transformers imported it
    assert not list(work.glob("*.pth"))


@pytest.mark.slow
def test_xtuner_train_offline_hub_id_ends_in_our_message(tmp_path, offline_hub):
    """`xtuner train` itself (status 0 whatever happens): our message, no hub traceback."""
    proc = xtuner_train(tmp_path / "work", config=recipe(tmp_path, HUB_ID))
    out = proc.stdout + proc.stderr
    assert "ConfigConflict: xtuner-rope: 1 setting(s)" in out and OFFLINE in out, out[-3000:]
    assert "OSError" not in out and "LocalEntryNotFoundError" not in out
    assert proc.returncode == 0  # XTuner's CLI drops the status: why `xtuner-rope train` exists
    assert os.environ["HF_HUB_OFFLINE"] == "1"  # and so the child's (xtuner_train copies it)


def test_the_checkpoint_judged_is_the_one_xtuner_loads(tmp_path, offline_hub):
    """Inside `set_model_resource` the top-level path is written into the model's right after
    the start-up: that one is judged; outside (the re-check after `--cfg-options`), the model's."""
    from xtuner.tools.utils import set_model_resource

    tiny = str(sc.ensure_tiny_model())
    config = recipe(tmp_path, tiny)
    cfg = Config.fromfile(str(config))
    cfg.model.llm.pretrained_model_name_or_path = HUB_ID  # the model's own, about to be replaced
    assert [f.setting for f in checkpoint_config_findings(cfg)] == [SETTING]
    with startup.state_kept():  # XTuner's own: enable_xtuner_rope(top-level path), write-back
        set_model_resource(cfg)
    assert cfg.model.llm.pretrained_model_name_or_path == tiny
    assert checkpoint_config_findings(cfg) == []


def test_internvl_whole_model_path_is_left_to_its_own_findings(tmp_path, offline_hub):
    """InternVL names its whole model (`model.model_path`; the top-level path XTuner's start-up
    reads is set from it), no `model.llm`: neither checkpoint rule judges it, not even inside
    `set_model_resource` (its own findings do); an LLM path next to it would be judged."""
    from xtuner.tools.utils import set_model_resource

    internvl = tmp_path / "internvl"
    internvl.mkdir()
    (internvl / "config.json").write_text(
        json.dumps(
            {"model_type": "internvl_chat", "auto_map": {"AutoModel": "m.InternVLChatModel"}}
        )
    )
    seen = []

    def judge(path):
        seen.extend(model_family_findings(cfg) + checkpoint_config_findings(cfg))
        return path

    cfg = Config(
        dict(
            pretrained_model_name_or_path=str(internvl),
            model_resource=dict(fn=judge),
            model=dict(type="InternVL_V1_5", model_path=str(internvl)),
        )
    )
    set_model_resource(cfg)
    assert seen == [] and checkpoint_config_findings(cfg) == []
    cfg.model.llm = dict(pretrained_model_name_or_path=HUB_ID)  # negative control
    assert [f.setting for f in checkpoint_config_findings(cfg)] == [SETTING]
