# The two commands of a fresh machine (run from the repository root):
#   make demo   install, then fine-tune the tiny InternLM2 on data/ with `xtuner train`, 5% held out
#   make test   install, then run the test suite (what CI runs)
#   make test-all   make test plus the opt-in runs that prove a claim a second time
#   make test-fast   the unit tests only (no tests/integration, no `slow` runs): a few minutes
#   make test-compat   opt-in: the fast tests and 2-process ZeRO-2/3 runs on other torch and
#                      DeepSpeed releases, each in its own .venv-compat-* (tools/test_compat.sh)
#   make lint   ruff check and ruff format --check
#   make docs   build the documentation site (docs/, mkdocs.yml) into site/, strict
#   make gpu-kit   the wheels the GPU machine lacks, one part of at most 58 MiB
#                  (tools/gpu/build_kit.sh); there: bash tools/gpu/run_gpu.sh (docs/gpu.md)
.PHONY: setup demo test test-all test-fast test-compat bench lint docs gpu-kit

VENV := $(CURDIR)/.venv
# `xtuner train` starts `python`/`torchrun` from PATH: the venv must come first.
RUN := PATH=$(VENV)/bin:$$PATH
DEMO_DIR := work_dirs/tiny_internlm2_short_dialogues

setup:
	bash tools/setup_env.sh

demo: setup
	rm -rf $(DEMO_DIR)
	$(RUN) xtuner train configs/tiny_internlm2_short_dialogues_heldout.py --work-dir $(DEMO_DIR)
	$(RUN) python tools/check_run.py $(DEMO_DIR) --min-iters 140

# Two pytest workers (the machine's 2 cores: a real run's imports and data steps leave a core
# idle), each taking whole test files, so the runs a module shares stay in one process.
# TEST_WORKERS=0 runs in this process (no xdist). --no-loadscope-reorder: files in the order
# tests/conftest.py sorts them (real runs first, then files with a slow run, then the rest);
# pytest-xdist 3.8 otherwise hands out the files with the most tests first, which left the
# zoo sweep and the one-step runs (files of one to four tests) to the last minutes, one worker
# waiting on the other.
TEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)
# One OpenMP thread per process: two workers (and the runs they start) already fill the two
# cores, and the tiny models gain nothing from a second thread (measured: a 40-iteration run of
# the tiny recipe used 12.7-14.3 s of CPU with one thread, 16.4 s with two).
TEST_RUN := $(RUN) OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1}
# Runs that prove a claim a second time, and the by-hand runs of minutes: out of CI.
OPT_IN := XTUNER_ROPE_AGAIN=1 XTUNER_ROPE_RESUME_BY_HAND=1 XTUNER_ROPE_HELDOUT_BY_HAND=1 \
	XTUNER_ROPE_TRAIN_BENCH_BY_HAND=1
# Our own .pyc files, written once before the tests: with PYTHONDONTWRITEBYTECODE set (as on CI)
# no import writes them, and each of the suite's hundreds of processes compiled xtuner_rope again
# (0.65 s of import time each). Stale ones are ignored by Python (it checks the source's mtime).
PYC := $(RUN) python -m compileall -q xtuner_rope tests tools >/dev/null

test: setup
	$(PYC)
	$(TEST_RUN) python -m pytest -q $(XDIST) --durations=25

# Everything, with the opt-in runs (tests/support/opt_in.py and the *_BY_HAND switches): hours.
test-all: setup
	$(PYC)
	$(TEST_RUN) $(OPT_IN) python -m pytest -q $(XDIST) --durations=25

# Everyday work: no real `xtuner train` / multi-process run (tests/integration, `-m slow`).
test-fast: setup
	$(PYC)
	$(TEST_RUN) python -m pytest -q $(XDIST) --ignore=tests/integration -m "not slow"

# Opt-in, never part of `make test`: builds its own environments (a few GB each, kept for the
# next run). COMPAT_MATRIX="TORCH:TORCHVISION:DEEPSPEED ..." and COMPAT_STEPS override.
test-compat:
	bash tools/test_compat.sh

bench: setup
	$(RUN) python tools/bench/rope.py
	$(RUN) python tools/bench/packing.py

lint: setup
	$(RUN) ruff check .
	$(RUN) ruff format --check .

docs: setup
	$(RUN) mkdocs build --strict

gpu-kit:
	bash tools/gpu/build_kit.sh
