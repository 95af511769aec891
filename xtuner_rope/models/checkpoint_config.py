"""The one reader of a checkpoint's ``config.json``, before anything of the model loads.

:func:`read_checkpoint_config` finds it where ``from_pretrained`` would (``<dir>/config.json``;
a hub id's cached file, else, unless offline, that file alone), once per process;
:attr:`CheckpointConfig.problem` says why it cannot be read. No torch or transformers import.
"""

from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

HUB_TIMEOUT_S = 10  # for config.json's metadata; from_pretrained would retry for ~30 s


@dataclass(frozen=True)
class CheckpointConfig:
    """A checkpoint's ``config.json``, or why it cannot be read.

    Attributes:
        name: ``pretrained_model_name_or_path`` as the config gives it.
        source: The file read (the hub's from the local cache); ``""`` when none was.
        data: The parsed ``config.json``; None when it cannot be read.
        problem: Why it cannot be read (``""`` when it was).
        hub: ``name`` is a hub id (not a local path).
    """

    name: str
    source: str = ""
    data: dict | None = field(default=None, repr=False)
    problem: str = ""
    hub: bool = False

    def get(self, key: str, default: object = None) -> object:
        """``config.json[key]``; ``default`` when absent or unreadable."""
        return (self.data or {}).get(key, default)


def _parse(name: str, text: str, source: str, hub: bool) -> CheckpointConfig:
    try:
        data = json.loads(text)
    except ValueError as err:
        return CheckpointConfig(name, problem=f"{source} is not valid JSON ({err})", hub=hub)
    if not isinstance(data, dict):
        return CheckpointConfig(name, problem=f"{source} holds no JSON object", hub=hub)
    return CheckpointConfig(name, source, data, hub=hub)


def is_hub_id(name: str) -> bool:
    """``name`` is a valid Hugging Face repo id (``org/name`` or ``name``)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def offline() -> bool:
    """Offline mode of ``huggingface_hub`` / transformers, as set in the environment."""
    truthy = ("1", "ON", "YES", "TRUE")
    return any(
        os.environ.get(var, "").upper() in truthy
        for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def _read_local(name: str, path: Path) -> CheckpointConfig:
    if path.is_dir():
        config = path / "config.json"
        if not config.is_file():
            return CheckpointConfig(
                name, problem=f"the directory {path} has no config.json (not a checkpoint)"
            )
        try:
            return _parse(name, config.read_text(encoding="utf-8"), str(config), hub=False)
        except OSError as err:
            return CheckpointConfig(name, problem=f"{config} cannot be read ({err})")
    return CheckpointConfig(name, problem=f"{path} is a file, not a checkpoint directory")


def _hub_endpoint() -> str:
    """The hub ``huggingface_hub`` downloads from: ``HF_ENDPOINT`` (a mirror) or huggingface.co,
    read at each call (as :func:`offline` is) so a mirror set after its import is followed too."""
    from huggingface_hub import constants

    return os.environ.get("HF_ENDPOINT", "").rstrip("/") or constants.ENDPOINT


def _hub_problem(name: str, endpoint: str, err: Exception) -> str:
    """What ``hf_hub_download``'s error means for the user: what, where, what to do."""
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{endpoint}/{name}"
    if isinstance(err, LocalEntryNotFoundError) and err.__cause__ is not None:
        err = err.__cause__  # what hf_hub_download met on the way: a connection, an HTTP error
    if not isinstance(err, HfHubHTTPError):
        root = re.search(r"Caused by (\w+)", str(err))  # urllib3's root cause, e.g. DNS
        reason = type(err).__name__ + (f", {root.group(1)}" if root else "")
        return (
            "no such local directory, and as a hub id it is not in the local Hugging Face cache "
            f"and {endpoint} cannot be reached from here ({reason})"
        )
    status = err.response.status_code if err.response is not None else "?"
    if isinstance(err, GatedRepoError):
        why = "gated (accept its terms on the hub, then `huggingface-cli login`)"
    elif isinstance(err, RepositoryNotFoundError):  # the hub answers so for private repos too
        why = "no such repo, or a gated/private one (check the id; `huggingface-cli login`)"
    elif isinstance(err, RevisionNotFoundError):
        why = "no such revision of the repo (check the revision)"
    elif isinstance(err, EntryNotFoundError):
        why = "the repo has no config.json (not a transformers checkpoint; check the id)"
    else:
        why = "the hub failed to answer (try again later, or download it where it answers)"
    return (
        "no such local directory, and as a hub id the hub does not give its config.json "
        f"({where}: HTTP {status}: {why})"
    )


@functools.lru_cache(maxsize=64)
def _read_hub(name: str, offline_mode: bool, cache_dir: str, endpoint: str) -> CheckpointConfig:
    """``config.json`` of hub id ``name``: the local cache, else downloaded into it (remembered)."""
    from huggingface_hub import hf_hub_download, try_to_load_from_cache

    cached = try_to_load_from_cache(name, "config.json", cache_dir=cache_dir)
    if not isinstance(cached, str):
        if offline_mode:
            return CheckpointConfig(
                name,
                problem="no such local directory, and as a hub id it is not in the local Hugging "
                "Face cache while offline mode is on (HF_HUB_OFFLINE/TRANSFORMERS_OFFLINE)",
                hub=True,
            )
        import requests

        try:  # a few kilobytes; proxies, token and mirror (HF_ENDPOINT) as from_pretrained
            cached = hf_hub_download(
                name,
                "config.json",
                cache_dir=cache_dir,
                endpoint=endpoint,
                etag_timeout=HUB_TIMEOUT_S,
            )
        except (requests.RequestException, OSError) as err:  # the hub's errors are both
            return CheckpointConfig(name, problem=_hub_problem(name, endpoint, err), hub=True)
    try:
        return _parse(name, Path(cached).read_text(encoding="utf-8"), cached, hub=True)
    except OSError as err:
        return CheckpointConfig(name, problem=f"{cached} cannot be read ({err})", hub=True)


def read_checkpoint_config(name: object) -> CheckpointConfig | None:
    """The :class:`CheckpointConfig` of the checkpoint ``from_pretrained(name)`` would load
    (``problem`` set when it cannot be read); None when ``name`` is not a non-empty string."""
    if not isinstance(name, str) or not name:
        return None
    path = Path(name).expanduser()
    if path.exists():
        return _read_local(name, path)
    if not is_hub_id(name):
        return CheckpointConfig(
            name, problem=f"no such directory ({path.absolute()}), and not a hub id (org/name)"
        )
    from huggingface_hub import constants

    return _read_hub(name, offline(), str(constants.HF_HUB_CACHE), _hub_endpoint())


__all__ = ["CheckpointConfig", "is_hub_id", "offline", "read_checkpoint_config"]
