"""The torch and DeepSpeed releases xtuner-rope supports with XTuner 0.2.0, checked once.

:data:`SUPPORTED` holds each range, why it ends there and the releases tested (``make
test-compat``). Outside it: one :class:`UnsupportedVersionWarning` per package, and the start-up
refuses the configs that use it (``config.patch_needs.version_findings``).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from . import guard

__all__ = [
    "SUPPORTED",
    "UnsupportedVersionWarning",
    "VersionRange",
    "unsupported",
    "version_message",
    "warn_unsupported",
]


class UnsupportedVersionWarning(UserWarning):
    """torch or DeepSpeed is outside the range xtuner-rope supports with XTuner 0.2.0."""


@dataclass(frozen=True)
class VersionRange:
    """The releases of one package xtuner-rope supports, and what happens outside them.

    Attributes:
        dist: The distribution name (``torch``).
        spec: The PEP 440 range (``>=2.4``).
        why: Why the range ends there.
        tested: The releases that ran, oldest first (docs/compat.md).
        install: The pip command that brings a supported release.
        used_by: The configs the start-up refuses outside the range, in words.
    """

    dist: str
    spec: str
    why: str
    tested: tuple[str, ...]
    install: str
    used_by: str

    def contains(self, version: str) -> bool:
        """True if ``version`` is inside the range (pre-releases and local tags included)."""
        return SpecifierSet(self.spec).contains(Version(version), prereleases=True)


SUPPORTED: dict[str, VersionRange] = {
    "torch": VersionRange(
        dist="torch",
        spec=">=2.4",
        why="torch 2.4 is the oldest release xtuner-rope declares (setup.cfg); older ones "
        "never ran",
        tested=("2.4.1", "2.15.0"),
        install="pip install 'torch>=2.4' with its own torchvision (e.g. torch==2.15.0 "
        "torchvision==0.29.2, or torch==2.4.1 torchvision==0.19.1)",
        used_by="every config",
    ),
    "deepspeed": VersionRange(
        dist="deepspeed",
        spec=">=0.17.6,<0.19.7",
        why="mmengine 0.10.6 (pinned by XTuner 0.2.0) cannot import DeepSpeed 0.19.7 or "
        "later (deepspeed.runtime.fp16.onebit was removed), and 0.17.6 is the oldest "
        "DeepSpeed the tests ran on",
        tested=("0.17.6", "0.18.9", "0.19.0", "0.19.6"),
        install="pip install 'deepspeed>=0.17.6,<0.19.7'",
        used_by="configs that use DeepSpeed (--deepspeed, a DeepSpeedStrategy)",
    ),
}


def version_message(dist: str, found: str) -> str:
    """What is wrong with ``dist`` ``found``, the supported range and what to install."""
    supported = SUPPORTED[dist]
    return (
        f"{dist} {found} is outside the versions xtuner-rope supports with XTuner 0.2.0 "
        f"({dist}{supported.spec}; tested: {', '.join(supported.tested)}): {supported.why}. "
        f"Install a supported release: {supported.install}"
    )


def unsupported() -> dict[str, str]:
    """Each installed package of :data:`SUPPORTED` outside its range -> :func:`version_message` (one
    not installed left out; a version string that is not PEP 440 counts as outside)."""
    found = {}
    for dist, supported in SUPPORTED.items():
        version = guard.installed_version(dist)
        if version is None:
            continue
        try:
            inside = supported.contains(version)
        except InvalidVersion:
            inside = False
        if not inside:
            found[dist] = version_message(dist, version)
    return found


_WARNED: set[str] = set()


def warn_unsupported() -> dict[str, str]:
    """One :class:`UnsupportedVersionWarning` per package outside its range, once per process;
    returns :func:`unsupported`'s answer (warned or not)."""
    found = unsupported()
    for dist, message in found.items():
        if dist not in _WARNED:
            _WARNED.add(dist)
            warnings.warn(
                f"xtuner_rope: {message}. The start-up refuses {SUPPORTED[dist].used_by}.",
                UnsupportedVersionWarning,
                stacklevel=2,
            )
    return found
