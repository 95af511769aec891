"""The guard every third-party patch runs in: versions checked, targets probed, failures kept.

:func:`run_guarded` runs a patch only when its :class:`PatchRecord`'s versions hold and every
probe resolves; otherwise, or if it raises, one :class:`CompatPatchSkipped` warning, and the
start-up refuses the configs that need its feature (``config.patch_needs``).
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata

from packaging.specifiers import SpecifierSet
from packaging.version import Version

__all__ = [
    "CompatPatchSkipped",
    "CompatPatchUnavailable",
    "PatchRecord",
    "applied",
    "at_least",
    "check_only",
    "install_hint",
    "installed_version",
    "outcomes",
    "require",
    "run_guarded",
    "skip_message",
    "skipped",
]


class CompatPatchSkipped(UserWarning):
    """A patch of a third-party package was not applied: its feature is unavailable here."""


@dataclass(frozen=True)
class PatchRecord:
    """What one patch was written for, what it replaces and what it serves.

    Attributes:
        name: The patch function's name (``patch_checkpoint_writes``).
        versions: Distribution -> PEP 440 versions it was written for (not installed: no gap).
        probes: What it reads or replaces (``"module"`` or ``"module:Attr.attr"``), all resolved
            before it runs.
        feature: The user-visible feature it serves (named in the warning and the refusal).
        symptom: What goes wrong without it (short; docs/compat.md has the long story).
        when: Where the gap can exist at all (``cpu_only``); None: everywhere.
        probe_note: Why ``probes`` is empty, where the patch finds its own target.
        needs: ``(configs that need the feature, in words; a condition of
            config.patch_needs.CONDITIONS)``: refused where the patch was skipped.
        not_refused: Why no config is refused for its absence (exactly one of the two is given).
    """

    name: str
    versions: dict[str, str]
    probes: tuple[str, ...]
    feature: str
    symptom: str
    when: Callable[[], bool] | None = field(default=None, compare=False)
    probe_note: str = ""
    needs: tuple[str, str] | None = None
    not_refused: str = ""

    def supported(self) -> str:
        """The versions as a reader wants them: ``mmengine ~=0.10.6, xtuner ~=0.2.0``."""
        return ", ".join(f"{dist} {spec}" for dist, spec in self.versions.items())


# name -> "applied" | "not needed: ..." | "skipped: <reason>"; one entry per patch run here.
_OUTCOMES: dict[str, str] = {}
# name -> what each probe of an applied patch resolved to right after it ran: the guard knows its
# own wrappers, so a patch is not run twice over them even where ``_OUTCOMES`` was reset.
_LEFT: dict[str, tuple] = {}
_SKIPPED = "skipped: "


def installed_version(dist: str) -> str | None:
    """The installed version of distribution ``dist``, None if it is not installed."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def at_least(dist: str, minimum: str) -> bool:
    """True if distribution ``dist`` is installed at ``minimum`` or later: the package's one version
    check (``Version`` of the installed release; ``+cu128`` counts as the release it tags).
    """
    version = installed_version(dist)
    return version is not None and Version(version).release >= Version(minimum).release


def _resolve(probe: str) -> object:
    """Import ``probe``'s module and read its attribute path; raise if either is missing."""
    module_name, _, attrs = probe.partition(":")
    target = importlib.import_module(module_name)
    for attr in filter(None, attrs.split(".")):
        target = getattr(target, attr)
    return target


def _same(left: object, right: object) -> bool:
    """``left is right``, or equal bound methods (a ``classmethod`` read twice)."""
    try:
        return left is right or bool(left == right)
    except Exception:  # an object whose == is not a truth value (a tensor)
        return False


def _holds(now: object, left: object) -> bool:
    """``now`` is ``left``, or wraps it (``functools.wraps``' ``__wrapped__`` chain): a later
    patch of the same target (DPO's ``_gather_masked_logits`` has two) keeps the first one's."""
    for _ in range(16):  # a chain of wrappers, never a cycle
        if _same(now, left):
            return True
        now = getattr(now, "__wrapped__", None)
        if now is None:
            return False
    return False


def _still_applied(record: PatchRecord) -> bool:
    """True if every probe still holds what ``record``'s patch left there (its own wrapper,
    perhaps inside a later patch's); False without probes (such a patch recognises its own
    target, ``probe_note``)."""
    left = _LEFT.get(record.name)
    return bool(left) and all(
        _holds(_resolve(probe), was) for probe, was in zip(record.probes, left)
    )


def _why_not(record: PatchRecord) -> tuple[str, str] | None:
    """("not needed"|"skipped", reason) if ``record``'s patch must not run here, else None."""
    if record.when is not None and not record.when():
        return "not needed", "its gap does not exist here"
    found = []
    for dist, spec in record.versions.items():
        version = installed_version(dist)
        if version is None:
            return "not needed", f"{dist} is not installed"
        found.append(f"{dist} {version}")
        if Version(version) not in SpecifierSet(spec):
            return "skipped", f"{dist} {version} is outside the versions it was written for"
    for probe in record.probes:
        try:
            _resolve(probe)
        except (ImportError, AttributeError) as error:
            return (
                "skipped",
                f"{probe} is missing ({type(error).__name__}: {error}) in {', '.join(found)}",
            )
    return None


def _skip(record: PatchRecord, reason: str) -> bool:
    """Record ``record`` as skipped and warn once; always False (nothing applied)."""
    if _OUTCOMES.get(record.name, "").startswith(_SKIPPED):
        return False
    _OUTCOMES[record.name] = _SKIPPED + reason
    warnings.warn(
        f"xtuner_rope.compat: {record.name} not applied, so '{record.feature}' is unavailable: "
        f"{reason}. It supports {record.supported()}. The start-up refuses configs that need "
        f"it; to use it, install those versions ({install_hint(record)}).",
        CompatPatchSkipped,
        stacklevel=3,
    )
    return False


def install_hint(record: PatchRecord) -> str:
    """The pip command that installs the versions ``record`` was written for."""
    return "pip install " + " ".join(f"'{d}{s}'" for d, s in record.versions.items())


def skip_message(record: PatchRecord) -> str:
    """Why ``record``'s patch was skipped here, and what to do (empty if it was not)."""
    reason = skipped().get(record.name)
    if reason is None:
        return ""
    return (
        f"{record.name} (for '{record.feature}') was skipped: {reason}. It supports "
        f"{record.supported()}: {install_hint(record)}"
    )


class CompatPatchUnavailable(RuntimeError):
    """A patch applied for one call was skipped: running unpatched would be silently wrong."""


def require(record: PatchRecord) -> None:
    """Check a patch applied later (for one call) before it runs; refuse if it was skipped.

    Raises:
        CompatPatchUnavailable: its versions or probes do not hold here; names the feature,
            the versions it supports and the pip command.
    """
    if not check_only(record) and record.name in skipped():
        raise CompatPatchUnavailable(
            f"xtuner_rope.compat: {skip_message(record)}. Without it "
            f"'{record.feature}' would run unpatched."
        )


def check_only(record: PatchRecord) -> bool:
    """Versions and probes of a patch applied later (in a hook, for one call); True if it may run."""
    verdict = _why_not(record)
    if verdict is None:
        _OUTCOMES.setdefault(record.name, "deferred")
        return True
    kind, reason = verdict
    if kind == "skipped":
        return _skip(record, reason)
    _OUTCOMES[record.name] = f"not needed: {reason}"
    return False


def run_guarded(
    record: PatchRecord, patch: Callable[..., object], *args, once: bool = True, **kwargs
) -> object:
    """Run ``patch(*args, **kwargs)`` if ``record``'s versions and probes hold; never raise.

    "Already applied" is the guard's: applied in this process, or its probes still hold what it
    left there. ``once=False`` (``DEFERRED``: applied for one call) runs each time. Returns the
    patch's own result (True once applied), or False where skipped or not needed.
    """
    if once and _OUTCOMES.get(record.name) == "applied":
        return True
    verdict = _why_not(record)
    if verdict is not None:
        kind, reason = verdict
        if kind == "skipped":
            return _skip(record, reason)
        _OUTCOMES.setdefault(record.name, f"not needed: {reason}")
        return False
    if once and _still_applied(record):
        _OUTCOMES[record.name] = "applied"
        return True
    try:
        result = patch(*args, **kwargs)
    except Exception as error:  # a release changed what the patch relies on: skip, say so
        return _skip(record, f"it raised {type(error).__name__}: {error}")
    if result:
        _OUTCOMES[record.name] = "applied"
        _LEFT[record.name] = tuple(_resolve(probe) for probe in record.probes)
    else:
        _OUTCOMES.setdefault(record.name, "not needed: the patch found no gap")
    return result


def outcomes() -> dict[str, str]:
    """Every patch run in this process -> "applied", "deferred", "not needed: ..." or "skipped: ..."."""
    return dict(_OUTCOMES)


def skipped() -> dict[str, str]:
    """The patches skipped in this process -> why (version, missing target, error)."""
    return {k: v[len(_SKIPPED) :] for k, v in _OUTCOMES.items() if v.startswith(_SKIPPED)}


def applied() -> list[str]:
    """The patches applied in this process, in the order they were first applied."""
    return [k for k, v in _OUTCOMES.items() if v == "applied"]
