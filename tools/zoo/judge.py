"""What a row's logs and captures say: its outcome, the doctor's reasons, whether they agree."""

from __future__ import annotations

import json
import re
from pathlib import Path

TRAINED = "trained isolated"
REFUSED = "refused before loading"
# Refused after the model loaded, at the first moment the data makes the problem knowable (the
# warm-up rounding of ``xtuner_rope.config.warmup`` needs ``len(train_dataloader)``), never later.
REFUSED_AT_DATA = "refused before training"
LACKS = "needs what this machine lacks"
CRASHED = "crashed"
LEAKED = "leaked"
# Trained, but its batch held no packed row of two documents or more: isolation not shown.
NOT_EXERCISED = "not exercised"
# A file beside the configs that is no training config (a DeepSpeed json, a conversion script).
NOT_A_TRAINING_CONFIG = "not a training config"
# The sweep's own failure (its edits left a hub path, its compare raised): says nothing about
# the config or the doctor, so the doctor is not judged on it.
SWEEP_ERROR = "sweep error"
OUTCOMES = (
    TRAINED,
    NOT_EXERCISED,
    REFUSED,
    REFUSED_AT_DATA,
    LACKS,
    NOT_A_TRAINING_CONFIG,
    CRASHED,
    LEAKED,
    SWEEP_ERROR,
)
# Settings whose refusal needs the built dataset (so it comes after the model has loaded).
DATA_SETTINGS = ("param_scheduler",)
ISOLATION_TOLERANCE = 1e-5  # fp32: |packed - alone| <= tol * max(1, |logit|)
PREFERENCE_KINDS = ("dpo", "orpo", "reward")


def last_error(out: str) -> str:
    """The last exception line of a log (``SomethingError: ...``), else its last line."""
    lines = [x.strip() for x in out.splitlines() if x.strip()]
    errors = [x for x in lines if re.match(r"^[\w.]*(Error|Exception|Conflict)\b.*:", x)]
    return (errors or lines or ["(no output)"])[-1][:300]


def refusal_of(out: str) -> str | None:
    """The start-up's refusal (first named setting), if the log has one."""
    if "ConfigConflict" not in out and "setting(s) of this config would make" not in out:
        return None
    match = re.search(r"^1\. (.*)$", out, re.M)
    return (match.group(1) if match else last_error(out))[:300]


def refused_settings(out: str) -> list[str]:
    """The settings a refusal lists (``1. setting: problem`` lines of the last refusal)."""
    head = out.rfind("setting(s) of this config would make")
    if head < 0:
        return []
    return re.findall(r"^\d+\. ([^:\n]+):", out[head:], re.M)


def doctor_reasons(report: Path, out: str) -> list[str]:
    """What the doctor named: its conflicts and problems (``setting: problem``), else its error.

    Args:
        report: The doctor's ``report.json`` (absent when it stopped before writing one).
        out: Its console output.
    """
    if report.is_file():
        data = json.loads(report.read_text(encoding="utf-8"))
        found = [
            f"{c['setting']}: {c['problem']}"
            for c in (data.get("findings") or {}).get("conflicts", [])
        ]
        return [x[:400] for x in found + [str(p) for p in data.get("problems", [])]]
    listed = (
        re.findall(r"^\d+\. (.+)$", out[max(out.find("setting(s) of this config"), 0) :], re.M)
        if "setting(s) of this config would make" in out
        else []
    )
    return [x[:400] for x in listed] or [last_error(out)]


def _setting(reason: str) -> str:
    return reason.split(":", 1)[0].strip()


def doctor_agrees(row: dict) -> bool | None:
    """Whether the doctor's verdict equals the row's outcome, reason included.

    Exit 0 is right only for a run that trained isolated. Exit 1 is right only when the doctor
    named what stopped the run: every setting the run refused among the doctor's settings, or a
    crash's (leak's) error text in one of the doctor's reasons. None where the run could not
    show its outcome here (``LACKS``), where the sweep itself failed (``SWEEP_ERROR``), or
    the row predates recorded reasons. A run that trained without showing isolation
    (``NOT_EXERCISED``) asks for exit 0.
    """
    doctor = row.get("doctor") or {}
    if row["outcome"] in (LACKS, SWEEP_ERROR, NOT_A_TRAINING_CONFIG) or "exit_code" not in doctor:
        return None
    if row["outcome"] == NOT_EXERCISED:  # it trained: the doctor must have let it
        return doctor["exit_code"] == 0
    if doctor["exit_code"] == 0 or row["outcome"] == TRAINED:
        return doctor["exit_code"] == 0 and row["outcome"] == TRAINED
    reasons = doctor.get("reasons")
    if reasons is None:
        return None
    if row["outcome"] in (REFUSED, REFUSED_AT_DATA):
        named = {_setting(r) for r in reasons}
        return bool(row.get("refused")) and set(row["refused"]) <= named
    error = re.sub(r"^[\w.]*(Error|Exception)\b:\s*", "", str(row.get("message", ""))).strip()
    return bool(error) and any(error[:80] in r for r in reasons)


LACK_PATTERNS = (  # (log regex, what this machine lacks)
    (
        r"Torch not compiled with CUDA|CUDA (is )?(not available|driver)|"
        r"requires? (a )?(CUDA|GPU)|CUDA is required|No GPU found|needs a GPU|"
        r"Found no NVIDIA driver",
        "a CUDA GPU",
    ),
    (r"flash_attn|FlashAttention2 has been toggled on", "flash-attn (CUDA)"),
    (r"Failed to import modelscope|No module named 'modelscope'", "ModelScope (its hub)"),
    (r"contains custom code which must be executed", "the checkpoint's remote code (offline)"),
    (
        r"(offline mode|couldn't connect|is not a local folder|"
        r"does not appear to have a file|We couldn't connect|LocalEntryNotFoundError|"
        r"Cannot find the requested files|OfflineModeIsEnabled|Couldn't reach)",
        "the checkpoint or data from the hub (offline)",
    ),
)


def crashed_in(out: str) -> bool:
    """Whether the log ends in a traceback (the last 40 lines hold one)."""
    return "Traceback (most recent call last)" in "\n".join(out.splitlines()[-40:])


def lacks_of(out: str) -> str | None:
    """What the machine lacks, when the end of the log (the traceback) says so."""
    tail = "\n".join(out.splitlines()[-40:])
    return next((what for pattern, what in LACK_PATTERNS if re.search(pattern, tail)), None)


def judge_run(code: int, out: str, work: Path, config: Path, iters: int, kind: str = "sft") -> dict:
    """The outcome of one training run (see :data:`OUTCOMES`) with its evidence.

    Args:
        code: The training process's exit status.
        out: Its log (stdout and stderr).
        work: Its work dir (the run's log and the capture file).
        config: The config it trained.
        iters: How many iterations it had to log.
        kind: :func:`tools.zoo.classes.kind_of`.
    """
    if code == 0 and crashed_in(out):  # a launcher that exits 0 whatever happened
        code = 1
    if code != 0:
        refusal = refusal_of(out)
        if refusal:
            return {"outcome": REFUSED, "message": refusal, "refused": refused_settings(out)}
        lacks = lacks_of(out)
        if lacks:
            return {"outcome": LACKS, "message": f"{lacks}: {last_error(out)}"}
        if re.search(r"xtuner_rope/capture/\w+\.py", "\n".join(out.splitlines()[-60:])):
            # the traceback runs through the sweep's own capture hook: its failure, not the config's
            return {"outcome": SWEEP_ERROR, "message": f"capture hook: {last_error(out)}"}
        return {"outcome": CRASHED, "message": last_error(out)}
    from xtuner_rope.capture.text import CAPTURE_FILE, compare_capture
    from xtuner_rope.demo.runlog import check_run

    try:
        run = check_run(work, min_iters=iters)
    except RuntimeError as exc:
        return {"outcome": CRASHED, "message": str(exc)[:300]}
    row = {"losses": [round(x, 4) for x in run.losses]}
    if kind in PREFERENCE_KINDS:
        return {**row, **judge_preference(work, config)}
    if kind in ("llava", "internvl"):
        return {**row, **judge_llava(work, config, kind)}
    capture = work / CAPTURE_FILE
    if not capture.is_file():
        return {**row, "outcome": CRASHED, "message": "trained but saved no isolation capture"}
    try:
        result = compare_capture(config, capture)
    except Exception as exc:  # noqa: BLE001 - a row, not the sweep, fails
        return {**row, "outcome": SWEEP_ERROR, "message": f"capture compare: {exc}"[:300]}
    return {**row, **judge_capture(result)}


def judge_capture(result: dict) -> dict:
    """A text capture's verdict: leaked, trained isolated, or not exercised (no packed row held
    two documents).

    Args:
        result: :func:`xtuner_rope.capture.text.compare_capture`'s answer: its
            ``per_document`` entries carry ``row``, ``max_abs_diff`` and ``max_abs_logit``.
    """
    row = {}
    worst = max(d["max_abs_diff"] / max(1.0, d["max_abs_logit"]) for d in result["per_document"])
    dtype = result["dtype"]
    tolerance = isolation_tolerance(dtype)
    per_row: dict[int, int] = {}
    for doc in result["per_document"]:
        per_row[doc["row"]] = per_row.get(doc["row"], 0) + 1
    row.update(
        documents=result["documents"],
        most_in_a_row=max(per_row.values()),
        max_abs_diff=result["max_abs_diff"],
        relative=worst,
        boundaries=result["boundaries"],
        dtype=dtype,
        tolerance=tolerance,
    )
    in_dtype = "" if dtype == "float32" else f" ({dtype} run, tolerance {tolerance:.3g})"
    if worst > tolerance:
        return {
            **row,
            "outcome": LEAKED,
            "message": f"max |trained - alone| {result['max_abs_diff']:.3g} (relative "
            f"{worst:.3g}){in_dtype}",
        }
    if max(per_row.values()) < 2:
        return {
            **row,
            "outcome": NOT_EXERCISED,
            "message": f"no row held two documents ({len(per_row)} row(s) of one): isolation "
            f"not exercised (max |trained - alone| {result['max_abs_diff']:.3g}{in_dtype})",
        }
    return {
        **row,
        "outcome": TRAINED,
        "message": f"{result['documents']} documents ({max(per_row.values())} in one row), "
        f"max |trained - alone| {result['max_abs_diff']:.3g}{in_dtype}",
    }


def judge_preference(work: Path, config: Path) -> dict:
    """Each captured response's values (log-probs; the reward token's hidden states) against
    the response alone through the unpatched model, relative to ``max(1, |value|)``."""
    from xtuner_rope.capture.preference import (
        PREFERENCE_CAPTURE_FILE,
        compare_preference_capture,
    )

    capture = work / PREFERENCE_CAPTURE_FILE
    if not capture.is_file():
        return {"outcome": CRASHED, "message": "trained but saved no preference capture"}
    try:
        result = compare_preference_capture(config, capture)
    except Exception as exc:  # noqa: BLE001 - a row, not the sweep, fails
        return {"outcome": SWEEP_ERROR, "message": f"preference capture compare: {exc}"[:300]}
    worst = max(
        diff / max(1.0, max(abs(v) for v in result["alone"][name]))
        for name, diff in result["max_abs_diff"].items()
    )
    states = result.get("reward_token_states") or {}
    if states:
        worst = max(worst, states["max_abs_diff"])
    row = {
        "documents": 2 * result["pairs"],
        "relative": worst,
        "dtype": "float32",
        "tolerance": ISOLATION_TOLERANCE,
        "boundaries": "cumulative_len" if result["packed"] else "unpacked (one response a row)",
    }
    control = (
        f"unpatched packed row: {max(result['leak_max_abs_diff'].values()):.3g}"
        if result["packed"]
        else "unpacked: one response a row, nothing to isolate"
    )
    what = (
        f"{result['pairs']} {result['kind']} pairs, responses vs alone relative {worst:.3g}"
        f" ({control})"
    )
    if worst > ISOLATION_TOLERANCE:
        return {**row, "outcome": LEAKED, "message": what}
    return {**row, "outcome": TRAINED if result["packed"] else NOT_EXERCISED, "message": what}


def isolation_tolerance(dtype: str) -> float:
    """Relative tolerance on the logits of a run in ``dtype``: fp32's, or ``check``'s for a
    half-precision run (``torch_dtype=torch.bfloat16`` configs train in bf16 on CPU too)."""
    from xtuner_rope.check.report import TOLERANCES

    return ISOLATION_TOLERANCE if dtype == "float32" else TOLERANCES[dtype]["logits"]


def judge_llava(work: Path, config: Path, kind: str = "llava") -> dict:
    """Each captured sample's LLM logits (after the image expansion) against the sample alone;
    ``kind`` ``internvl``: InternVL's capture (same figures)."""
    if kind == "internvl":
        from xtuner_rope.capture.internvl import INTERNVL_CAPTURE_FILE as capture_file
        from xtuner_rope.capture.internvl import compare_internvl_capture as compare
    else:
        from xtuner_rope.capture.llava import LLAVA_CAPTURE_FILE as capture_file
        from xtuner_rope.capture.llava import compare_llava_capture as compare
    what = "InternVL" if kind == "internvl" else "LLaVA"
    capture = work / capture_file
    if not capture.is_file():
        return {"outcome": CRASHED, "message": f"trained but saved no {what} capture"}
    try:
        result = compare(config, capture)
    except Exception as exc:  # noqa: BLE001 - a row, not the sweep, fails
        return {"outcome": SWEEP_ERROR, "message": f"{what} capture compare: {exc}"[:300]}
    worst = max(s["max_abs_diff"] / max(1.0, s["max_abs_logit"]) for s in result["per_sample"])
    per_row: dict[int, int] = {}
    for sample in result["per_sample"]:
        per_row[sample["row"]] = per_row.get(sample["row"], 0) + 1
    if worst <= ISOLATION_TOLERANCE and max(per_row.values()) < 2:
        return {
            "documents": result["samples"],
            "most_in_a_row": 1,
            "relative": worst,
            "outcome": NOT_EXERCISED,
            "message": f"no row held two samples ({len(per_row)} padded row(s) of one): "
            f"isolation not exercised (max |trained - alone| {result['max_abs_diff']:.3g})",
        }
    unpatched = result.get("unpatched_max_abs_diff")
    control = "" if unpatched is None else f" (same rows unpatched: {unpatched:.3g})"
    return {
        "most_in_a_row": max(per_row.values()),
        "documents": result["samples"],
        "relative": worst,
        "dtype": "float32",
        "tolerance": ISOLATION_TOLERANCE,
        "boundaries": "LLaVA samples",
        "outcome": LEAKED if worst > ISOLATION_TOLERANCE else TRAINED,
        "message": f"{result['samples']} image/text samples, max |trained - alone| "
        f"{result['max_abs_diff']:.3g}{control}",
    }


def loaded_weights(out: str) -> bool:
    """Whether the log shows weights loaded (a refusal after that is too late)."""
    return bool(re.search(r"Loading checkpoint shards|ValidatedRoPEHook: \d+", out))


def doctor_verdict(out: str, code: int) -> str:
    lines = [x.strip() for x in out.splitlines() if x.strip()]
    verdict = next((x for x in reversed(lines) if re.match(r"^(OK|FAIL)\b", x)), None)
    return (verdict or last_error(out))[:300] if code else (verdict or "OK")[:300]


def rejudge(row: dict) -> dict:
    """A recorded row under the current rule: "trained isolated" needs a row that held two
    documents. Rows recorded before the rule carry their document count and boundaries only:
    one document, or an unpacked preference batch (one response a row), is "not exercised"."""
    if row.get("outcome") != TRAINED:
        return row
    most = row.get("most_in_a_row")
    single = most < 2 if most is not None else row.get("documents", 2) < 2
    if not (single or str(row.get("boundaries", "")).startswith("unpacked")):
        return row
    message = f"no row held two documents: isolation not exercised (recorded: {row['message']})"
    return {**row, "outcome": NOT_EXERCISED, "message": message[:300]}
