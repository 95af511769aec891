"""One row of the sweep and the sweep itself: copy, edit, doctor, train, judge; resumable."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from tools.zoo.classes import mode_of
from tools.zoo.data import (
    tiny_checkpoint,
    write_llava_images,
    write_preference_data,
    write_universal_data,
)
from tools.zoo.formats import MOSS_FILES, write_moss_data
from tools.zoo.intern_repo import with_intern_repo_data
from tools.zoo.internvl import internvl_checkpoint, internvl_llm_of
from tools.zoo.judge import (
    CRASHED,
    DATA_SETTINGS,
    LACKS,
    LEAKED,
    NOT_A_TRAINING_CONFIG,
    REFUSED,
    REFUSED_AT_DATA,
    SWEEP_ERROR,
    doctor_agrees,
    doctor_reasons,
    doctor_verdict,
    judge_run,
    loaded_weights,
)
from tools.zoo.localize import (
    LLAVA_LLM_OF_PREFIX,
    LocalFiles,
    family_of,
    localized,
    model_ids,
    surviving_paths,
)
from tools.zoo.refcoco import write_refcoco_data

# The stock config a ``--deepspeed`` file (``xtuner list-cfg`` lists them too) is launched with.
DEEPSPEED_HOST = "internlm2_chat_1_8b_qlora_alpaca_e3"
# One process under a launcher: DeepSpeed otherwise looks for MPI (``mpi4py``).
ONE_PROCESS = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
SHORT_RUN = ("train_cfg.max_epochs=None", "randomness.seed=0", "default_hooks.logger.interval=1")


def list_configs(patterns: Iterable[str] = ("*",)) -> list[str]:
    """Stock config names of ``xtuner list-cfg`` matching a glob pattern, in pattern order
    (the first pattern's matches first: the order of the command line is the priority)."""
    from xtuner.configs import cfgs_name_path

    names: list[str] = []
    for pattern in patterns:
        names += [
            n for n in sorted(cfgs_name_path) if fnmatch.fnmatch(n, pattern) and n not in names
        ]
    return names


def not_a_config(text: str) -> str:
    """What a listed file that is no training config is: a script, by the functions it defines."""
    defs = ", ".join(re.findall(r"^def (\w+)", text, re.M)) or "no function"
    return f"a script shipped beside the configs (defines {defs}), no model = dict(...) to train"


# ---------------------------------------------------------------- running one row


def offline_env(extra: dict | None = None) -> dict:
    """The rows' environment: offline hub, one thread, this interpreter's scripts first."""
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
    )
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return {**env, **(extra or {})}


def run_logged(
    cmd: list[str], cwd: Path, timeout: int, log: Path, env: dict | None = None
) -> tuple[int, str]:
    """Run ``cmd`` in ``cwd`` (exit 124 on timeout); its output is written to ``log``."""
    try:
        proc = subprocess.run(
            cmd, cwd=cwd, env=offline_env(env), capture_output=True, text=True, timeout=timeout
        )
        code, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        code = 124
        out = f"{exc.stdout or ''}{exc.stderr or ''}\nzoo: timed out after {timeout} s"
    log.write_text(out if isinstance(out, str) else out.decode(errors="replace"), encoding="utf-8")
    return code, out if isinstance(out, str) else out.decode(errors="replace")


def copy_stock(name: str, folder: Path) -> Path:
    """Step 1: what ``xtuner copy-cfg NAME FOLDER`` writes, the stock file a user starts from.

    XTuner's own copy steps (its name-to-file table and its ``_copy`` suffix) in this process,
    not the command: the command is two Python processes (~4 s of CPU, an eighth of a trained
    row) for a file copy. ``tests/config/test_startup.py::
    test_copy_stock_writes_what_xtuner_copy_cfg_writes`` runs the real command and compares.

    Returns:
        The copy's path.

    Raises:
        KeyError: ``name`` is not one of XTuner's stock configs.
    """
    from xtuner.configs import cfgs_name_path
    from xtuner.tools.copy_cfg import add_copy_suffix

    if name not in cfgs_name_path:
        raise KeyError(f"{name!r} is not one of XTuner's stock configs (`xtuner list-cfg`)")
    folder.mkdir(parents=True, exist_ok=True)
    source = Path(cfgs_name_path[name])
    target = folder / add_copy_suffix(source.name)
    shutil.copyfile(source, target)
    return target


def local_files(name: str, kind: str, root: Path, data: Path, models: Path) -> LocalFiles:
    """Step 2: the tiny checkpoint of the row's family (built once), and the local data."""
    from xtuner_rope.demo.tiny_clip import save_tiny_clip

    family = family_of(name)
    if kind == "llava":
        family = next((f for p, f in LLAVA_LLM_OF_PREFIX if name.startswith(p)), None)
    clip = models / "tiny-clip"
    if kind == "llava" and not (clip / "config.json").is_file():
        save_tiny_clip(clip)
    model = (
        internvl_checkpoint(internvl_llm_of(name), models)
        if kind == "internvl"
        else tiny_checkpoint(family, models)
    )
    return LocalFiles(
        model=model,
        data=data,
        pairs=root / "data" / "preference_pairs.jsonl",
        clip=clip,
        llava_json=root / "data" / "llava" / "llava_data.json",
        moss={tools: root / "data" / "moss" / f for tools, f in MOSS_FILES.items()},
        refcoco=root / "data" / "llava" / "refcoco_train.json",
    )


def run_doctor(config: Path, folder: Path, batches: int, deepspeed: str | None) -> dict:
    """Step 4: ``xtuner-rope doctor`` on the edited config: exit code, verdict, reasons."""
    cmd = [sys.executable, "-m", "xtuner_rope.cli", "doctor", str(config)]
    cmd += ["--out", str(folder / "doctor"), "--batches", str(batches)]
    cmd += ["--deepspeed", deepspeed] if deepspeed else []
    code, out = run_logged(cmd, folder, 600, folder / "doctor.log")
    return {
        "exit_code": code,
        "verdict": doctor_verdict(out, code),
        "reasons": doctor_reasons(folder / "doctor" / "report.json", out) if code else [],
    }


def run_training(config: Path, folder: Path, iters: int, deepspeed: str | None) -> tuple[int, str]:
    """Step 5: ``iters`` iterations of the real training script, a checkpoint at the end (stock
    ``save_steps = -1`` configs save none); one process under ``--deepspeed``."""
    cmd = [sys.executable, "-m", "xtuner.tools.train", str(config), "--work-dir"]
    cmd += [str(folder / "work"), "--cfg-options", *SHORT_RUN, f"train_cfg.max_iters={iters}"]
    cmd += [f"default_hooks.checkpoint.interval={iters}"]
    env = None
    if deepspeed:
        cmd += ["--deepspeed", deepspeed, "--launcher", "pytorch"]
        env = {**ONE_PROCESS, "MASTER_PORT": str(29500 + os.getpid() % 1000)}
    return run_logged(cmd, folder, 900, folder / "train.log", env)


def settle(row: dict, out: str) -> dict:
    """Step 7: a refusal of the data's settings comes after loading by nature; any other
    refusal after the weights loaded is too late (a crash); then the doctor's score."""
    if row["outcome"] == REFUSED and row["refused"]:
        if all(s.startswith(DATA_SETTINGS) for s in row["refused"]):
            row["outcome"] = REFUSED_AT_DATA  # as soon as the data's length is known
    if row["outcome"] == REFUSED and loaded_weights(out):
        row["outcome"], row["message"] = CRASHED, "refused after loading: " + row["message"]
    row["predicted"] = doctor_agrees(row)
    return row


def run_row(
    name: str, root: Path, data: Path, models: Path, iters: int = 4, doctor_batches: int = 20
) -> dict:
    """Sweep one stock config; returns its row (never raises for the config's own failure).

    Steps: copy it (:func:`copy_stock`), point it at local files (:func:`local_files`,
    :func:`~tools.zoo.localize.localized`; a hub path left behind is a sweep error),
    run the doctor (:func:`run_doctor`), train (:func:`run_training`), judge the run
    (:func:`~tools.zoo.judge.judge_run`) and score the doctor (:func:`settle`). A
    ``--deepspeed`` file is swept as the launch of :data:`DEEPSPEED_HOST` with it.
    """
    start = time.time()
    folder = root / "rows" / name
    shutil.rmtree(folder, ignore_errors=True)  # a re-run never reads an earlier run's files
    folder.mkdir(parents=True)
    row = {"config": name, "family": family_of(name), "date": time.strftime("%Y-%m-%d")}
    try:
        stock = copy_stock(DEEPSPEED_HOST if name.startswith("deepspeed_") else name, folder)
    except KeyError as exc:
        return {**row, "outcome": SWEEP_ERROR, "message": f"copy: {exc.args[0]}", "seconds": 0}
    text = stock.read_text(encoding="utf-8")
    deepspeed = name if name.startswith("deepspeed_") else None
    row["mode"] = mode_of(text, DEEPSPEED_HOST if deepspeed else name)
    kind = row["mode"]["kind"]
    if kind == "script":
        return {
            **row,
            "outcome": NOT_A_TRAINING_CONFIG,
            "message": not_a_config(text),
            "seconds": 0,
        }
    files = local_files(DEEPSPEED_HOST if deepspeed else name, kind, root, data, models)
    files = with_intern_repo_data(text, files, folder, models)  # its own folder and format
    row["checkpoint"] = "tiny (built here)" if files.model else "hub id (no tiny builder here)"
    try:
        config_text = localized(text, kind, files)
    except ValueError as exc:
        return {**row, "outcome": SWEEP_ERROR, "message": str(exc), "seconds": 0}
    kept = () if files.model else model_ids(text)  # no tiny builder: the hub id stays
    left = surviving_paths(text, config_text, kept)
    if left:
        message = f"zoo: the localizer left {left} in the config"
        return {**row, "outcome": SWEEP_ERROR, "message": message, "seconds": 0}
    config = folder / f"{name}.py"
    config.write_text(config_text, encoding="utf-8")
    row["doctor"] = run_doctor(config, folder, doctor_batches, deepspeed)
    code, out = run_training(config, folder, iters, deepspeed)
    row.update(judge_run(code, out, folder / "work", config, iters, kind))
    return {**settle(row, out), "seconds": round(time.time() - start)}


# ---------------------------------------------------------------- the sweep


def load_results(path: Path) -> dict:
    """``{config: row}`` of a results file (empty when absent)."""
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def select(names: list[str], results: dict, only: str) -> list[str]:
    """The configs to run: ``missing`` (not in results), ``failed`` (crashed, leaked, a sweep
    error, or mispredicted by the doctor), or ``all``."""
    if only == "all":
        return names
    if only == "missing":
        return [n for n in names if n not in results]
    if only == "failed":
        return [
            n
            for n in names
            if n in results
            and (
                results[n]["outcome"] in (CRASHED, LEAKED, SWEEP_ERROR)
                or doctor_agrees(results[n]) is False
                or (
                    doctor_agrees(results[n]) is None
                    and results[n]["outcome"] not in (LACKS, NOT_A_TRAINING_CONFIG)
                )
            )
        ]
    raise ValueError(f"zoo: only={only!r}: expected one of missing, failed, all")


def sweep(
    patterns: list[str],
    root: Path,
    results_path: Path,
    jobs: int = 1,
    only: str = "missing",
    iters: int = 4,
    models: Path | None = None,
    progress: Callable[[int, int, dict], None] | None = None,
) -> dict:
    """Run the selected rows (``jobs`` at a time), saving the results file after each row.

    Tiny checkpoints are built once per family under ``models`` (default ``root/models``).

    Returns:
        All rows of the results file (the new ones included).
    """
    root = Path(root).resolve()  # each row runs in its own folder: no path may be relative
    root.mkdir(parents=True, exist_ok=True)
    results = load_results(results_path)
    names = select(list_configs(patterns), results, only)
    # The dialogues alone in their folder: a loader that reads a whole folder (the intern-repo
    # untokenized dataset walks it) must not meet the pairs or the LLaVA data.
    data = write_universal_data(root / "data" / "dialogues")
    write_preference_data(root / "data")  # once, before the workers read it
    write_llava_images(root / "data" / "llava")
    write_moss_data(root / "data" / "moss")  # MOSSSFTDataset's own JSON lines
    write_refcoco_data(root / "data" / "llava", root / "data" / "llava" / "images")
    models = Path(models).resolve() if models else root / "models"
    for family in sorted({family_of(n) for n in names} - {None}):
        tiny_checkpoint(family, models)  # once, before the workers race for it
    for llm in sorted({internvl_llm_of(n) for n in names if n.startswith("internvl")} - {None}):
        internvl_checkpoint(llm, models)
    lock = threading.Lock()
    done = 0
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = {pool.submit(run_row, n, root, data, models, iters): n for n in names}
        for future in as_completed(futures):
            name = futures[future]
            try:
                row = future.result()
            except Exception as exc:  # noqa: BLE001 - the sweep goes on
                row = {"config": name, "outcome": SWEEP_ERROR, "message": f"zoo: {exc}"[:300]}
            with lock:
                results = load_results(results_path)
                results[name] = row
                results_path.parent.mkdir(parents=True, exist_ok=True)
                tmp = results_path.with_suffix(".tmp")
                tmp.write_text(json.dumps(results, indent=1, sort_keys=True), encoding="utf-8")
                tmp.replace(results_path)
                done += 1
            if progress:
                progress(done, len(names), row)
    return load_results(results_path)
