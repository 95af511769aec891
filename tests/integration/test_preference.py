"""XTuner's stock DPO, ORPO and reward-model varlen configs through the real `xtuner train`.

Each config is copied with `xtuner copy-cfg`, localized (tiny InternLM2 with hub-style remote
code, or a tiny Llama for the Llama 3 LoRA DPO config, a few hundred local pairs, fp32
optimizer, see preference_configs.py) and turned on with the README's one edit. Runs: one
process (DPO, ORPO, LoRA DPO; the reward model opt-in, ``make test-all``), 2 processes with DDP (DPO) and with DeepSpeed ZeRO-2
(ORPO, reward; DPO under ZeRO-2/3 verified by hand, see docs/incoming/s6-pref.md). `PreferenceCaptureHook` saves iteration 3 (after two optimizer steps,
so policy != reference and the reward head is no longer zero): every chosen/rejected log-prob
of policy and reference, and every reward score, computed on the packed row must equal the
response run alone through the unpatched model, summed in float64 by the test; the same row
through the unpatched model (the leak without the plugin) must not. Held-out pairs
(``heldout = dict(fraction=0.1, interval=2)``): the DPO run on one process and the ORPO and
reward ZeRO-2 runs on two log held-out figures equal to a fresh no-plugin process on the
run's checkpoint (``tests/support/preference_heldout_reference.py``). Each of these runs
carries both claims, isolation and held-out figures (the one-process DPO run: the module's
``dpo_run``, shared by two tests). Issue 57's opt-out pairs: the ORPO ZeRO-2 run and (opt-in)
the LoRA DPO run, module-shared, each against a twin with ``chunked_loss=False`` (docs/loss.md).
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path

import preference_configs as pc
import pytest
import stock_configs as sc
from mmengine.config import Config
from opt_in import again

from xtuner_rope.capture.preference import capture_file, compare_preference_capture
from xtuner_rope.config import startup
from xtuner_rope.config.findings import ConfigConflict
from xtuner_rope.demo.runlog import check_run
from xtuner_rope.demo.tiny import save_tiny

pytestmark = pytest.mark.slow

RUN = (
    "train_cfg.max_epochs=None",
    "train_cfg.max_iters=3",
    "randomness.seed=0",
    "default_hooks.logger.interval=1",
    "log_processor.window_size=1",  # each iteration's own figures (the opt-out pairs compare them)
)
# A free token of the tiny vocabulary (1,024 ids, 6 special): ids 6.. are ordinary pieces,
# but the reward token only has to be inside the vocabulary for this test.
REWARD_TOKEN = 7
# fp32 sums of ~100 log-probs of magnitude ~7 against float64: relative rounding ~1e-7.
RTOL = 1e-5
# Measured leak of the unpatched packed row at iteration 3 (tiny model): DPO 0.15-0.37 nats,
# ORPO 0.0125-0.0195 (average log-prob): far above RTOL.
LEAK_FLOOR = {"dpo": 1e-2, "orpo": 1e-3}


@pytest.fixture(scope="module")
def pref(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("preference")
    sc.ensure_tiny_model()
    model = sc.tiny_with_remote_code(root / "tiny-remote")
    data = pc.write_preference_pairs(root / "pairs.jsonl", n=200)
    configs = {}
    llama = save_tiny(root / "tiny-llama", family="llama")
    for name in (pc.DPO, pc.ORPO, pc.REWARD, pc.LLAMA_DPO_QLORA, pc.DPO_UNPACKED):
        copy = sc.copy_stock(name, root)
        token = REWARD_TOKEN if name == pc.REWARD else None
        text = pc.localize_preference(
            copy,
            name,
            data,
            reward_token_id=token,
            model=llama if name == pc.LLAMA_DPO_QLORA else model,
        )
        configs[name] = root / f"{name}.py"
        configs[name].write_text(pc.with_preference_capture(sc.enable_plugin(text)))
        configs[f"{name}_stock_token"] = root / f"{name}_stock_token.py"
        configs[f"{name}_stock_token"].write_text(
            sc.enable_plugin(pc.localize_preference(copy, name, data, model=model))
        )
    return {"root": root, "model": model, **configs}


def _assert_isolated(config: Path, capture: Path, kind: str) -> dict:
    result = compare_preference_capture(config, capture)
    assert result["kind"] == kind and result["pairs"] >= 2, result
    for name, values in result["alone"].items():
        diff = result["max_abs_diff"][name]
        scale = max(1.0, max(abs(v) for v in values))
        assert diff <= RTOL * scale, (name, diff, result["captured"][name], values)
    if kind == "reward":  # the head starts at zero: its scores move slowly, its inputs do not
        states = result["reward_token_states"]
        assert states["max_abs_diff"] <= RTOL and states["leak_max_abs_diff"] > 0.1, states
    else:
        assert min(result["leak_max_abs_diff"].values()) > LEAK_FLOOR[kind], result
    if "alone" in result["loss"]:
        assert abs(result["loss"]["captured"] - result["loss"]["alone"]) <= 1e-5, result["loss"]
    states = result["reward_token_states"]
    print(
        f"{kind}: {result['pairs']} pairs, max |trained - alone| "
        f"{max(result['max_abs_diff'].values()):.3g}, unpatched packed row off by "
        f"{max(result['leak_max_abs_diff'].values()):.3g}"
        + (
            f"; reward token states {states['max_abs_diff']:.3g}, unpatched "
            f"{states['leak_max_abs_diff']:.3g}"
            if states
            else ""
        )
        + (
            f"; loss {result['loss']['captured']:.7f} vs alone {result['loss']['alone']:.7f}"
            if "alone" in result["loss"]
            else "; loss not compared"
        )
    )
    return result


@pytest.fixture(scope="module")
def dpo_run(pref, tmp_path_factory) -> dict:
    """One single-process `xtuner train` of the stock DPO config with the capture hook and
    ``heldout = dict(fraction=0.1, interval=2)`` (3 iterations: held-out figures logged at 2
    and 3, the capture at 3), shared by the isolation and held-out claims."""
    root = tmp_path_factory.mktemp("dpo_run")
    config = root / "dpo_heldout.py"
    config.write_text(pref[pc.DPO].read_text() + HELDOUT)
    proc = sc.xtuner_train(config, root / "work", *RUN)
    return {"config": config, "work": root / "work", "out": proc.stdout + proc.stderr}


@pytest.fixture(scope="module")
def single_runs(pref, tmp_path_factory):
    """``run(name, *extra)``: one single-process `xtuner train` of ``pref[name]`` (3 iterations,
    the capture at 3), made once per module: ``(config, work dir, output)``. The LoRA DPO run is
    also the chunked partner of its ``chunked_loss=False`` twin."""
    done = {}

    def run(name: str, *extra: str) -> tuple[Path, Path, str]:
        if (name, *extra) not in done:
            work = tmp_path_factory.mktemp(f"{name}_run")
            proc = sc.xtuner_train(pref[name], work, *RUN, *extra)
            done[(name, *extra)] = pref[name], work, proc.stdout + proc.stderr
        return done[(name, *extra)]

    return run


@pytest.mark.parametrize(
    "name,kind",
    [
        (pc.DPO, "dpo"),
        (pc.ORPO, "orpo"),
        # The reward model has no one-process failure of its own (XTuner's RewardModel checks
        # for a process group; DPO and ORPO called dist.get_rank()): its isolation, the same
        # assertions, is proven in CI on each rank of the ZeRO-2 run.
        pytest.param(
            pc.REWARD,
            "reward",
            marks=again(
                "test_stock_preference_zero2_two_processes_isolated_on_every_rank[...-reward]"
            ),
        ),
        (pc.LLAMA_DPO_QLORA, "dpo"),
    ],
)
def test_stock_preference_config_trains_isolated_single_process(pref, name, kind, request):
    """A plain single-process `xtuner train` (no launcher): before, DPO/ORPO died in
    `dist.get_rank()` ("Default process group has not been initialized"). The Llama 3 QLoRA
    DPO config on a tiny Llama (LoRA without 4-bit, the stock lora_dropout 0.1: the capture
    runs its iteration with dropout off, as the responses alone are computed; with dropout
    on the policy log-probs differed by ~2e-3, relative 1.7e-5): the reference is the policy
    with its adapter disabled; the capture rebuilds both as plain models (adapter merged /
    removed). DPO and ORPO log-probs go through the chunked path (``chunked_loss``, logged).
    DPO: the run shared with the held-out test (``dpo_run``)."""
    if name == pc.DPO:
        run = request.getfixturevalue("dpo_run")
        config, work, out = run["config"], run["work"], run["out"]
    else:
        config, work, out = request.getfixturevalue("single_runs")(name)
    check_run(work, min_iters=3)
    assert "Default process group has not been initialized" not in out
    if kind != "reward":  # the log-probs came from the chunked path (docs/loss.md)
        model = kind.upper()
        assert f"chunked loss: {model}'s log-probs projects only the supervised" in out, out[-3000:]
    _assert_isolated(config, work / capture_file(), kind)


def test_stock_unpacked_dpo_trains_and_matches_each_response_alone(pref, tmp_path):
    """XTuner's stock DPO without varlen: ``preference_collate_fn`` puts each response in a
    row of its own (right-padded, ``attention_mask``), nothing to isolate; the capture still
    holds every log-prob the run computed, equal to the response alone, and no leak control
    (no packed row) is reported."""
    sc.xtuner_train(pref[pc.DPO_UNPACKED], tmp_path, *RUN)
    check_run(tmp_path, min_iters=3)
    result = compare_preference_capture(pref[pc.DPO_UNPACKED], tmp_path / capture_file())
    assert result["packed"] is False and result["leak_max_abs_diff"] == {}, result
    assert result["pairs"] == 1 and set(result["captured"]) == set(result["alone"]), result
    for name, values in result["alone"].items():
        assert result["max_abs_diff"][name] <= RTOL * max(1.0, *map(abs, values)), result
    assert abs(result["loss"]["captured"] - result["loss"]["alone"]) <= 1e-5, result["loss"]


def test_doctor_reads_unpacked_pairs_as_pairs(pref, tmp_path):
    """Unpacked pairs have no ``input_ids`` (``chosen_ids``/``rejected_ids``): the doctor
    scans each pair's two responses instead of reporting 200 empty samples and 200 batches
    without a supervised label (its verdict on the stock unpacked DPO config was a false
    FAIL while the run trained)."""
    import json

    from xtuner_rope.cli import main

    assert main(["doctor", str(pref[pc.DPO_UNPACKED]), "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["samples"]["empty"]["count"] == 0, report["samples"]
    assert report["collate"]["unsupervised_batches"]["count"] == 0, report["collate"]
    assert report["dataset"]["samples"] == report["preference"]["pairs"] == 200, report
    assert not report["packed"] and report["preference"]["packed"] is False, report


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_process_env() -> dict:
    """The environment of XTuner's torchrun launch on 2 CPU processes (a free port)."""
    return dict(
        sc.venv_env(),
        NPROC_PER_NODE="2",
        NNODES="1",
        PORT=str(_free_port()),
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
    )


def test_stock_dpo_two_processes_isolated_on_every_rank(pref, tmp_path):
    """`NPROC_PER_NODE=2 xtuner train --launcher pytorch` (torchrun, gloo): each rank's pack."""
    import subprocess

    cmd = [
        "xtuner",
        "train",
        str(pref[pc.DPO]),
        "--work-dir",
        str(tmp_path),
        "--launcher",
        "pytorch",
        "--cfg-options",
        *RUN,
        "env_cfg.dist_cfg.backend=gloo",
    ]
    env = _two_process_env()
    subprocess.run(cmd, cwd=sc.REPO, env=env, capture_output=True, text=True, timeout=900)
    check_run(tmp_path, min_iters=3)
    for rank in range(2):
        _assert_isolated(pref[pc.DPO], tmp_path / capture_file(rank, 2), "dpo")


ZERO2 = "configs/deepspeed/zero2_fp32_cpu.json"
ZERO3 = "configs/deepspeed/zero3_fp32_cpu.json"
# The stock 3% warm-up of an epoch rounds to 0 iterations on 2 processes with the reward
# rows (64 rows, 32 per rank): MMEngine's "end should be larger than begin". 10% of an epoch.
SHORT_WARMUP = ("param_scheduler.0.end=0.1", "param_scheduler.1.begin=0.1")


@pytest.fixture(scope="module")
def deepspeed_runs(pref, tmp_path_factory):
    """``run(name, *extra, deepspeed=ZERO2)``: one 2-process DeepSpeed `xtuner train` of
    ``pref[name]`` with ``HELDOUT`` (3 iterations), made once per module: ``(config, work dir,
    output)``. The ORPO runs are also the chunked partners of their ``chunked_loss=False`` twins."""
    import subprocess

    done = {}

    def run(name: str, *extra: str, deepspeed: str = ZERO2) -> tuple[Path, Path, str]:
        if (name, deepspeed, *extra) in done:
            return done[(name, deepspeed, *extra)]
        root = tmp_path_factory.mktemp(f"{name}_{Path(deepspeed).stem}")
        config = root / f"{name}_heldout.py"
        config.write_text(pref[name].read_text() + HELDOUT)
        work = root / "work"
        cmd = ["xtuner", "train", str(config), "--work-dir", str(work), "--launcher", "pytorch"]
        cmd += ["--deepspeed", deepspeed, "--cfg-options", *RUN, *SHORT_WARMUP]
        cmd += ["env_cfg.dist_cfg.backend=gloo", *extra]
        env = _two_process_env()
        proc = subprocess.run(
            cmd, cwd=sc.REPO, env=env, capture_output=True, text=True, timeout=900
        )
        done[(name, deepspeed, *extra)] = config, work, proc.stdout + proc.stderr
        return done[(name, deepspeed, *extra)]

    return run


@pytest.mark.parametrize("name,kind", [(pc.ORPO, "orpo"), (pc.REWARD, "reward")])
def test_stock_preference_zero2_two_processes_isolated_on_every_rank(name, kind, deepspeed_runs):
    """ORPO and the reward model on 2 processes under DeepSpeed ZeRO-2 (the project's fp32 CPU
    json, gloo): each rank's pack, measured inside the run, equals each response alone. The
    same runs hold out pairs (``heldout = dict(fraction=0.1, interval=2)``: 180 training pairs,
    the last 20 held out, evaluated at 2 and 3 on both ranks): the held-out loss, accuracy and
    margin logged at 3 equal a fresh process without the plugin on ``iter_3.pth`` (each pair
    alone through XTuner's own unpacked model)."""
    config, work, out = deepspeed_runs(name)
    summary = check_run(work, min_iters=3)
    # a DeepSpeed checkpoint is a directory of ZeRO shards (DDP writes one .pth file)
    assert (summary.checkpoint / "mp_rank_00_model_states.pt").is_file(), out[-3000:]
    pairs = [
        _assert_isolated(config, work / capture_file(rank, 2), kind)["pairs"] for rank in range(2)
    ]
    # the packing figures of rank 0's log: pairs per row of the captured (3rd) batch
    log = "\n".join(p.read_text() for p in work.glob("*/*.log"))
    line = next(x for x in log.splitlines() if "Iter(train) [3/3]" in x)
    logged = {
        k: float(re.search(rf"{k}: ([\d.]+)", line)[1])
        for k in ("pairs_per_row", "docs_per_row", "real_token_share")
    }
    assert logged["pairs_per_row"] == pairs[0] == logged["docs_per_row"] / 2, (logged, pairs)
    assert logged["real_token_share"] == 1.0, logged  # one packed row per batch: no padding
    _assert_heldout_equals_plain(config, work, kind, iters=(2, 3))


# DPO's loss is -log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r))) over sums of a
# response's log-probs (hundreds of nats): near the start the four sums cancel and the loss
# (~log 2) carries their fp32 summation-order rounding (~1e-7 of each sum, times beta 0.1) as an
# absolute error. Measured 7.7e-7 (1.1e-6 relative) at iteration 2 of the LoRA pair, 2026-11-29;
# twice that allowed. The chunk's NLL scaled by 1 + 1e-5 gave 2.6e-6: caught.
DPO_LOSS_ATOL = 1.5e-6


# A second proof (one more run): CI proves LoRA DPO's chunked loss and gradients in process, and
# that the run above logs its chunked log-probs.
@again("tests/compat/test_preference_chunked_logprobs.py::*[dpo_lora-*]")
def test_lora_dpo_chunked_loss_equals_the_models_own(single_runs):
    """Issue 57's opt-out pair for DPO with LoRA (1 process): the Llama 3 QLoRA DPO run above
    (LoRA without 4-bit on every linear layer but the head, dropout 0.1: the head draws no mask,
    so both runs draw the same ones) and the same run with ``chunked_loss=False`` give each of
    the 3 iterations' loss within 1e-6 relative plus ``DPO_LOSS_ATOL`` and the final adapter
    weights (all XTuner saves of a LoRA model) within 1e-6 relative norm (policy and reference
    log-probs chunked at every iteration)."""
    from opt_out import OPT_OUT, assert_logged, compare_runs, weights

    (_, chunked, out_c), (_, own, out_o) = (
        single_runs(pc.LLAMA_DPO_QLORA, *extra) for extra in ((), (OPT_OUT,))
    )
    assert_logged(out_c, out_o, "chunked loss: DPO's log-probs projects only the supervised")
    assert all("lora_" in name for name in weights(own / "iter_3.pth"))  # the adapter only
    compare_runs(chunked, own, "iter_3.pth", iters=3, loss_atol=DPO_LOSS_ATOL)


# CI time (the 2026-11-29 clean clone ran 30 min 27 s): opt-in; ORPO's chunked log-probs against
# the full logits are proven in CI in process, and the InternVL pair is CI's `xtuner train` pair.
@again("tests/compat/test_preference_chunked_logprobs.py (ORPO, packed and unpacked)")
def test_orpo_zero2_chunked_loss_equals_the_models_own(deepspeed_runs):
    """Issue 57's opt-out pair for ORPO on 2 processes under ZeRO-2: the ORPO run above
    (chunked log-probs, logged) and the same run with ``chunked_loss=False`` give each of the 3
    iterations' loss (rank 0's) and the held-out loss at 2 and 3 within 1e-6 relative, and the final weights (DeepSpeed's module)
    within 1e-6 relative norm (measured 1.4e-7; their change from the checkpoint differs by
    5.0e-6 relative, most of it in the input embedding, where AdamW turns gradients of rounding
    size into steps of the learning rate's)."""
    from opt_out import OPT_OUT, assert_logged, compare_runs

    (_, chunked, out_c), (_, own, out_o) = (deepspeed_runs(pc.ORPO, *x) for x in ((), (OPT_OUT,)))
    assert_logged(out_c, out_o, "chunked loss: ORPO's log-probs projects only the supervised")
    compare_runs(chunked, own, "iter_3.pth", iters=3, heldout=(2, 3))


# The head partitioned too: the json's default persistence threshold (1e5 elements) keeps the
# tiny model's parameters whole on every rank.
ZERO3_PARTITIONED = {"stage3_param_persistence_threshold": 0}


@again("tests/integration/test_chunked_loss_zero3.py (DPO's log-probs, the head partitioned)")
def test_orpo_zero3_chunked_loss_equals_the_models_own(deepspeed_runs, tmp_path_factory):
    """Issue 57's opt-out pair for ORPO on 2 processes under ZeRO-3, every parameter partitioned
    (the head's gathered once per forward and backward by the chunked loss): as the ZeRO-2 pair,
    each iteration's loss and the held-out loss at 2 and 3 within 1e-6 relative, the final
    weights (DeepSpeed's fp32 partitions, gathered) within 1e-6 relative norm."""
    import json

    from opt_out import OPT_OUT, assert_logged, compare_runs

    ds = json.loads((sc.REPO / ZERO3).read_text())
    ds["zero_optimization"].update(ZERO3_PARTITIONED)
    path = tmp_path_factory.mktemp("zero3") / "zero3_partitioned.json"
    path.write_text(json.dumps(ds))
    (_, chunked, out_c), (_, own, out_o) = (
        deepspeed_runs(pc.ORPO, *x, deepspeed=str(path)) for x in ((), (OPT_OUT,))
    )
    for work in (chunked, own):  # ZeRO-3's checkpoint: each rank's partition of the model
        check_run(work, min_iters=3)
        assert len(list((work / "iter_3.pth").glob("zero_pp_rank_*_model_states.pt"))) == 2
    assert_logged(out_c, out_o, "chunked loss: ORPO's log-probs projects only the supervised")
    compare_runs(chunked, own, "iter_3.pth", iters=3, heldout=(2, 3))


def _as_xtuner_train(monkeypatch, config: Path, *args: str) -> None:
    """This process's command line as `xtuner train` has it (the start-up reads --deepspeed)."""
    import xtuner.tools.train as train

    monkeypatch.setattr("sys.argv", [train.__file__, str(config), *args])


def test_full_dpo_under_zero3_refused_at_start(pref, monkeypatch):
    """XTuner's DPO deep-copies the policy as reference: under ZeRO-3 it raises after loading."""
    _as_xtuner_train(monkeypatch, pref[pc.DPO], "--deepspeed", str(sc.REPO / ZERO3))
    cfg = Config.fromfile(str(pref[pc.DPO]))
    with pytest.raises(
        ConfigConflict,
        match=r"model\.ref_llm \(DPO\) with DeepSpeed ZeRO-3: None: XTuner's DPO "
        r"then makes the reference model with create_reference_model.*\n"
        r"  -> set model\.ref_llm = dict\(type=AutoModelForCausalLM"
        r".*or train DPO with ZeRO-2",
    ):
        startup.prepare_config(cfg)
    cfg = Config.fromfile(str(pref[pc.DPO]))  # the edit: a reference model of its own
    cfg.model.ref_llm = cfg.model.llm.copy()
    startup.prepare_config(cfg)
    for other in (ZERO2, None):  # ZeRO-2 and no DeepSpeed: accepted
        args = ("--deepspeed", str(sc.REPO / other)) if other else ()
        _as_xtuner_train(monkeypatch, pref[pc.DPO], *args)
        startup.prepare_config(Config.fromfile(str(pref[pc.DPO])))


def test_stock_reward_token_outside_vocabulary_refused_at_start(pref):
    cfg = Config.fromfile(str(pref[f"{pc.REWARD}_stock_token"]))
    with pytest.raises(
        ConfigConflict,
        match=r"reward_token_id \(PART 1; train_dataloader\.dataset\."
        r"reward_token_id\): 92527 is outside the vocabulary .*vocab_size "
        r"1024.*\n  -> set reward_token_id to an id in 0\.\.1023",
    ):
        startup.prepare_config(cfg)


@pytest.mark.parametrize("name", [pc.DPO, pc.REWARD])
def test_packed_pairs_at_batch_size_two_refused_at_start(pref, name):
    cfg = Config.fromfile(str(pref[name]))
    cfg.train_dataloader.batch_size = 2
    with pytest.raises(
        ConfigConflict,
        match=r"train_dataloader\.batch_size: 2: packed preference pairs .*"
        r"asserts batch size 1.*\n  -> set batch_size = 1",
    ):
        startup.prepare_config(cfg)


def test_mismatched_varlen_switches_refused_at_start(pref):
    cfg = Config.fromfile(str(pref[pc.DPO]))
    cfg.model.use_varlen_attn = False
    with pytest.raises(
        ConfigConflict,
        match=r"use_varlen_attn: packed preference pairs need the same "
        r"use_varlen_attn .*model\.use_varlen_attn=False.*\n  -> set "
        r"use_varlen_attn = True",
    ):
        startup.prepare_config(cfg)


@pytest.mark.parametrize("name,kind", [(pc.REWARD, "reward"), (pc.ORPO, "orpo")])
def test_check_reward_and_orpo_models_pass(pref, name, kind, tmp_path, capsys):
    """`xtuner-rope check` on a reward config: before, AttributeError ('...has no attribute
    logits'); now the scores and the reward token's hidden states, packed vs alone. ORPO: its
    average log-probs; both: the model's own loss against the loss of the responses alone."""
    from xtuner_rope.cli import main

    assert main(["check", str(pref[name]), "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"XTuner {kind} model" in out and "PASS: every response" in out, out
    assert "float32 (tolerance 1e-05 relative)" in out, out
    captured, alone = map(
        float,
        re.search(
            r"loss     packed ([\d.]+) vs responses alone "
            r"([\d.]+)",
            out,
        ).groups(),
    )
    assert abs(captured - alone) <= 1e-5 and captured > 0.1, out


def test_check_dpo_without_plugin_fails_on_the_leak(pref, tmp_path, capsys):
    """The stock DPO config without the one edit: policy and reference log-probs leak, exit 1."""
    from xtuner_rope.cli import main

    text = pref[pc.DPO].read_text().replace(sc.PLUGIN_EDIT, "")
    config = tmp_path / "dpo_without_plugin.py"
    config.write_text(text)
    assert main(["check", str(config), "--out", str(tmp_path / "out")]) == 1
    out = capsys.readouterr().out
    assert "FAIL: policy_chosen: packed differs from each response alone" in out, out
    assert "reference_rejected" in out and "model_resource = dict(fn=enable_xtuner_rope)" in out


def test_check_orpo_without_plugin_fails_on_log_probs_and_loss(pref, tmp_path, capsys):
    """ORPO without the edit: the average log-probs and ORPO's own loss differ, with figures."""
    from xtuner_rope.cli import main

    config = tmp_path / "orpo_without_plugin.py"
    config.write_text(pref[pc.ORPO].read_text().replace(sc.PLUGIN_EDIT, ""))
    assert main(["check", str(config), "--out", str(tmp_path / "out")]) == 1
    out = capsys.readouterr().out
    assert re.search(r"FAIL: chosen: packed differs from each response alone by 0\.0\d+", out)
    captured, alone = map(
        float,
        re.search(
            r"problem: loss: packed ([\d.]+) vs responses alone "
            r"([\d.]+)",
            out,
        ).groups(),
    )
    # Beyond check's fp32 tolerance (1e-5 relative). How far depends on which pairs share the
    # first packed row (XTuner's PackedDatasetWrapper shuffles with numpy's global state):
    # measured 7.009718 vs 7.003515 and 7.004110 vs 7.004848.
    assert abs(captured - alone) > 1e-5 * max(1.0, abs(alone)), out


def test_doctor_counts_pairs_and_drops(pref, tmp_path, capsys):
    """Pairs, not packed rows, are described; pairs over max_packed_length are counted,
    against XTuner's own PackedDatasetWrapper bins."""
    import json

    from mmengine.config import Config
    from xtuner.registry import BUILDER

    from xtuner_rope.cli import main

    assert (
        main(
            [
                "doctor",
                str(pref[pc.DPO]),
                "--out",
                str(tmp_path),
                "--cfg-options",
                "train_dataloader.dataset.max_packed_length=200",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "report.json").read_text())["preference"]
    cfg = Config.fromfile(str(pref[pc.DPO]))
    cfg.train_dataloader.dataset.max_packed_length = 200
    packed = BUILDER.build(cfg.train_dataloader.dataset)
    kept = sum(len(bin_) for bin_ in packed.data)
    assert report["pairs"] == 200 and report["rows"] > 0, report  # packs: shuffle_before_pack
    assert report["dropped_over_max_packed_length"] == 200 - kept > 0, (report, kept)
    assert f"{200 - kept} pairs dropped" in out and "max_length=None" not in out, out
    assert "are dropped by PackedDatasetWrapper: raise max_packed_length" in out


def test_doctor_refuses_stock_reward_token(pref, tmp_path, capsys):
    from xtuner_rope.cli import main

    assert main(["doctor", str(pref[f"{pc.REWARD}_stock_token"]), "--out", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "PROBLEM      conflict: reward_token_id" in out and "92527 is outside" in out, out


HELDOUT_REFERENCE = Path(__file__).parents[1] / "support" / "preference_heldout_reference.py"
HELDOUT = "\nheldout = dict(fraction=0.1, interval=2)\n"
# The margin is a difference of rewards (DPO: beta * (log pi - log ref), each a sum of ~100
# fp32 log-probs; ORPO: beta * average log-probs; reward: scores): compared on that scale.
MARGIN_ATOL = 1e-6


def _assert_heldout_equals_plain(config: Path, work: Path, kind: str, iters: tuple) -> dict:
    """The held-out figures logged at ``iters`` (the last: the run's checkpoint) against a fresh
    process without the plugin on that checkpoint (``preference_heldout_reference.py``)."""
    import json
    import subprocess
    import sys

    (scalars,) = work.glob("*/vis_data/scalars.json")
    rows = [json.loads(line) for line in scalars.read_text().splitlines()]
    logged = {row["step"]: row for row in rows if "heldout_loss" in row}
    assert sorted(logged) == list(iters), sorted(logged)
    last = iters[-1]
    ref = subprocess.run(
        [
            sys.executable,
            str(HELDOUT_REFERENCE),
            str(config),
            str(work / f"iter_{last}.pth"),
            "train[90%:]",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=sc.venv_env(),
    )
    assert ref.returncode == 0, ref.stderr[-3000:]
    plain = json.loads(ref.stdout.strip().splitlines()[-1])
    at = logged[last]
    print(
        f"{kind} held-out at {last}: logged {at}, plain {plain}; loss "
        f"{abs(at['heldout_loss'] - plain['loss']) / plain['loss']:.2g} relative, margin "
        f"{abs(at['heldout_margin'] - plain['margin']):.2g} absolute"
    )
    assert at["heldout_pairs"] == plain["pairs"] == 20
    assert at["heldout_accuracy"] == plain["accuracy"]
    assert abs(at["heldout_loss"] - plain["loss"]) <= RTOL * plain["loss"]
    assert abs(at["heldout_margin"] - plain["margin"]) <= MARGIN_ATOL
    assert logged[iters[0]]["heldout_loss"] != at["heldout_loss"]  # the model moved between them
    return plain


def test_stock_dpo_heldout_equals_each_pair_alone(dpo_run):
    """The stock DPO config with ``heldout = dict(fraction=0.1, interval=2)`` through
    `xtuner train` (the run shared with the single-process isolation test): the start-up
    derives the held-out pairs (the last 10% of the file) and ``PreferenceMetric``; the
    held-out loss, accuracy and margin logged at iterations 2 and 3 must equal, at 3, what a
    fresh process without the plugin computes from ``iter_3.pth`` with each pair alone through
    the unpatched policy and reference (20 pairs)."""
    check_run(dpo_run["work"], min_iters=3)
    assert "val_evaluator=dict(type=PreferenceMetric)" in dpo_run["out"], dpo_run["out"][-3000:]
    # The held-out log-probs of policy and reference through the chunked path (docs/loss.md).
    assert "DPO's log-probs projects only the supervised" in dpo_run["out"]
    assert "the held-out log-probs too; opt out: chunked_loss = False" in dpo_run["out"]
    _assert_heldout_equals_plain(dpo_run["config"], dpo_run["work"], "dpo", iters=(2, 3))
