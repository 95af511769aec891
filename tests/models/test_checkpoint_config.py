"""The one reader of a checkpoint's ``config.json`` (``models.checkpoint_config``), and that it is
the one (its cases of hub ids, offline mode and the findings on top: ``tests/config/
test_checkpoint_findings.py``). A hub id goes through ``huggingface_hub.hf_hub_download``: here
to a hub mirror (``HF_ENDPOINT``) on this machine that answers as the hub does, never the hub."""

from __future__ import annotations

import ast
import http.server
import json
import re
import socket
import threading
from pathlib import Path

import pytest

import xtuner_rope
from xtuner_rope.models.checkpoint_config import read_checkpoint_config

PACKAGE = Path(xtuner_rope.__file__).parent
READER = PACKAGE / "models" / "checkpoint_config.py"


def reads_config_json(source: str) -> bool:
    """A function that names ``config.json`` and parses JSON: a reader of it."""
    functions = [
        ast.get_source_segment(source, node) or ""
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    ]
    return any(
        '"config.json"' in body and re.search(r"\bjson\.loads?\(", body) for body in functions
    )


def test_reads_a_local_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "vocab_size": 7}))
    config = read_checkpoint_config(str(tmp_path))
    assert config.source == str(tmp_path / "config.json") and config.get("vocab_size") == 7


def test_no_config_json_is_named(tmp_path):
    assert "has no config.json" in read_checkpoint_config(str(tmp_path)).problem
    assert read_checkpoint_config(None) is None


@pytest.mark.parametrize("text", ["{not json", "[1, 2]"])
def test_a_broken_config_json_is_named(tmp_path, text):
    (tmp_path / "config.json").write_text(text)
    config = read_checkpoint_config(str(tmp_path))
    assert config.data is None and re.search(
        r"config\.json (is not valid JSON|holds no JSON)", config.problem
    )


def test_the_package_has_one_reader():
    readers = [
        str(path.relative_to(PACKAGE))
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != READER and reads_config_json(path.read_text(encoding="utf-8"))
    ]
    assert not readers, (
        "read a checkpoint's config.json with xtuner_rope.models.checkpoint_config.read_checkpoint_config"
    )
    # Negative control: what the start-up's own reader looked like before, found.
    assert reads_config_json(
        'def heads(path):\n    config = Path(path) / "config.json"\n'
        '    return json.loads(config.read_text())["num_attention_heads"]\n'
    )


COMMIT = "1" * 40


class _Mirror(http.server.BaseHTTPRequestHandler):
    """A hub mirror (``HF_ENDPOINT``) answering as the hub does: ``config.json`` of ``org/served``,
    and the hub's error answers (status and ``X-Error-Code``) for the other repo ids."""

    body = json.dumps({"model_type": "qwen2", "vocab_size": 7}).encode()
    errors = {  # repo -> (status, X-Error-Code)
        "org/missing": (401, "RepoNotFound"),
        "org/gated": (403, "GatedRepo"),
        "org/no-config": (404, "EntryNotFound"),
        "org/busy": (429, ""),  # rate-limited (a 5xx is the same answer after 5 retries)
    }
    requests: list[str] = []

    def _answer(self, with_body: bool) -> None:
        type(self).requests.append(f"{self.command} {self.path}")
        repo = "/".join(self.path.strip("/").split("/")[:2])
        status, code = self.errors.get(repo, (200, ""))
        self.send_response(status)
        if code:
            self.send_header("X-Error-Code", code)
        self.send_header("X-Repo-Commit", COMMIT)
        self.send_header("ETag", '"config-etag"')
        self.send_header("Content-Length", str(len(self.body) if status == 200 else 0))
        self.end_headers()
        if with_body and status == 200:
            self.wfile.write(self.body)

    def do_HEAD(self):
        self._answer(with_body=False)

    def do_GET(self):
        self._answer(with_body=True)

    def log_message(self, *args):
        pass


@pytest.fixture
def mirror(tmp_path, monkeypatch):
    """A hub mirror on this machine, an empty Hugging Face cache, online mode."""
    from huggingface_hub import constants

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Mirror)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    _Mirror.requests = []
    yield endpoint
    server.shutdown()
    server.server_close()


def test_a_hub_id_is_downloaded_into_the_cache_through_the_mirror(mirror, tmp_path):
    config = read_checkpoint_config("org/served")
    assert config.problem == "" and config.hub and config.get("vocab_size") == 7, config
    assert config.source.startswith(str(tmp_path / "hf-cache")), config.source
    assert "GET /org/served/resolve/main/config.json" in _Mirror.requests
    asked = len(_Mirror.requests)
    assert read_checkpoint_config("org/served") == config  # remembered: no second request
    assert len(_Mirror.requests) == asked


@pytest.mark.parametrize(
    ("repo", "why"),
    [
        ("org/missing", "HTTP 401: no such repo, or a gated/private one (check the id; "),
        (
            "org/gated",
            "HTTP 403: gated (accept its terms on the hub, then `huggingface-cli login`)",
        ),
        ("org/no-config", "HTTP 404: the repo has no config.json (not a transformers checkpoint"),
        ("org/busy", "HTTP 429: the hub failed to answer (try again later"),
    ],
)
def test_the_hubs_answers_are_named(mirror, repo, why):
    config = read_checkpoint_config(repo)
    assert config.data is None and config.hub
    assert config.problem.startswith(
        "no such local directory, and as a hub id the hub does not give its config.json "
        f"({mirror}/{repo}: {why}"
    ), config.problem


@pytest.mark.slow
def test_an_unreachable_hub_is_named(mirror, monkeypatch):
    """~23 s asleep: the hub client retries a connection 5 times (1+2+4+8+8 s), as in
    ``from_pretrained``, before the reader names the hub it could not reach."""
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}"
    monkeypatch.setenv("HF_ENDPOINT", closed)
    config = read_checkpoint_config("org/served")
    assert config.problem == (
        "no such local directory, and as a hub id it is not in the local Hugging Face cache and "
        f"{closed} cannot be reached from here (ConnectionError, NewConnectionError)"
    ), config.problem
