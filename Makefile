# The two commands of a fresh machine (run from the repository root):
#   make demo   install, then fine-tune the tiny InternLM2 on data/ with `xtuner train`, 5% held out
#   make test   install, then run the test suite (everything: what CI runs)
#   make test-fast   the unit tests only (no tests/integration, no `slow` runs): a few minutes
#   make lint   ruff check and ruff format --check
#   make docs   build the documentation site (docs/, mkdocs.yml) into site/, strict
#   make gpu-kit   the wheels the GPU machine lacks, one part of at most 58 MiB
#                  (tools/gpu/build_kit.sh); there: bash tools/gpu/run_gpu.sh (docs/gpu.md)
.PHONY: setup demo test test-fast bench lint docs gpu-kit

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
# TEST_WORKERS=0 runs in this process (no xdist).
TEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

test: setup
	$(RUN) python -m pytest -q $(XDIST) --durations=25

# Everyday work: no real `xtuner train` / multi-process run (tests/integration, `-m slow`).
test-fast: setup
	$(RUN) python -m pytest -q $(XDIST) --ignore=tests/integration -m "not slow"

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
