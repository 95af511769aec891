"""Activation is explicit: importing a module of the package patches and registers nothing.

The ways in (``xtuner_rope.activate``: the compat patches, the hooks, collate functions and
metrics in MMEngine's registries, the findings): a config's start-up, which reads its
``model_resource`` function from the package (``from xtuner_rope import enable_xtuner_rope``,
read by XTuner's ``set_model_resource``), here; reading any public name,
``tests/test_cli.py::test_import_xtuner_rope_loads_the_start_up_and_no_tool``; a subcommand of
the command line, ``tests/test_cli.py::test_a_subcommand_activates_the_plugin_without_the_banners``.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from mmengine.config import Config

from xtuner_rope.config import startup
from xtuner_rope.config.findings import ConfigConflict

HEAD = 'pretrained_model_name_or_path = "internlm/internlm2-chat-1_8b"\n'
BY_NAME = "from xtuner_rope import enable_xtuner_rope\n"
BY_MODULE = "from xtuner_rope.config.startup import enable_xtuner_rope\n"
BODY = (
    "model_resource = dict(fn=enable_xtuner_rope)\n"
    'custom_hooks = [dict(type="PackingMetricsHook")]  # a string name: HOOKS must know it\n'
)
# A fresh interpreter: import modules of every floor, then start the config as `xtuner train`
# does (XTuner's own `set_model_resource`, bound before any plugin code ran, as train.py binds it).
STARTS = """
import json, sys
import xtuner_rope.ops, xtuner_rope.compat, xtuner_rope.config.startup, xtuner_rope.data.collate
import xtuner_rope.hooks, xtuner_rope.evaluation, xtuner_rope.demo.resources
import xtuner.tools.utils as xtuner_utils
from mmengine.config import Config
from mmengine.registry import FUNCTIONS, HOOKS
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from xtuner.tools.utils import set_model_resource
import xtuner_rope
from xtuner_rope.config import startup

def state():
    return {
        "activated": xtuner_rope._activated,
        "set_model_resource wrapped": hasattr(xtuner_utils.set_model_resource, "__wrapped__"),
        "internlm2 in Auto": "internlm2" in CONFIG_MAPPING,
        "hook registered": HOOKS.get("PackingMetricsHook") is not None,
        "collate registered": FUNCTIONS.get("rope_collate_fn") is not None,
        "prepared": startup.is_prepared(),
    }

print("IMPORTED " + json.dumps(state()))
try:
    set_model_resource(Config.fromfile(sys.argv[1]))
except Exception as error:
    print("BY_MODULE " + json.dumps([type(error).__name__, str(error)]))
set_model_resource(Config.fromfile(sys.argv[2]))
print("BY_NAME " + json.dumps(state()))
"""


def _lines(proc: subprocess.CompletedProcess) -> dict:
    found = {}
    for line in proc.stdout.splitlines():
        key, _, value = line.partition(" ")
        if key in ("IMPORTED", "BY_MODULE", "BY_NAME"):
            found[key] = json.loads(value)
    return found


def test_importing_activates_nothing_and_the_start_up_does(tmp_path):
    by_module, by_name = tmp_path / "by_module.py", tmp_path / "by_name.py"
    by_module.write_text(BY_MODULE + HEAD + BODY)
    by_name.write_text(BY_NAME + HEAD + BODY)
    proc = subprocess.run(
        [sys.executable, "-c", STARTS, str(by_module), str(by_name)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = _lines(proc)
    assert set(found["IMPORTED"].values()) == {False}, found["IMPORTED"]
    # The function read from a module path: no activation, so the start-up refuses to run.
    kind, message = found["BY_MODULE"]
    assert kind == "ConfigConflict" and "from xtuner_rope import enable_xtuner_rope" in message
    assert set(found["BY_NAME"].values()) == {True}, found["BY_NAME"]


def test_a_start_up_without_activation_names_the_import(monkeypatch):
    from xtuner.tools.utils import set_model_resource

    from xtuner_rope.config.startup import enable_xtuner_rope

    monkeypatch.setattr(startup, "_active", False)
    cfg = Config(
        dict(pretrained_model_name_or_path="nowhere", model_resource=dict(fn=enable_xtuner_rope))
    )
    with (
        startup.state_kept(),
        pytest.raises(
            ConfigConflict,
            match=r"model_resource.fn=enable_xtuner_rope: xtuner-rope is not active in this process.*\n"
            r"    from xtuner_rope import enable_xtuner_rope",
        ),
    ):
        set_model_resource(cfg)


# A thread reads a public name while another thread's activation is under way (the zoo sweep
# compares two runs' captures in threads): before the lock it found activation flagged done and
# the name not yet set (KeyError 'enable_xtuner_rope').
RACE = """
import threading, time
import xtuner_rope

activating = threading.Thread(target=xtuner_rope.activate)
activating.start()
while not xtuner_rope._activated:
    time.sleep(0.0005)
assert "enable_xtuner_rope" not in vars(xtuner_rope), "activation ended before the read"
print("READ", xtuner_rope.enable_xtuner_rope.__name__)
activating.join()
"""


def test_a_public_name_read_during_another_threads_activation_waits_for_it():
    proc = subprocess.run([sys.executable, "-c", RACE], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "READ enable_xtuner_rope" in proc.stdout
