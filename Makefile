# Two commands on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export MPLBACKEND := Agg
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export WANDB_MODE ?= offline

.PHONY: install lock test-latest lint format test test-all test-slow demo demo-grid demo-v4 robust robust-confirm robust-ablation selection paper mitigate pretrain csa2 smoke clean

# The installer the lock was made and last installed with (make lock refreshes both).
PIP_PIN := pip==26.3
PIP_TOOLS_PIN := pip-tools==7.7.0
LOCK := requirements-dev.lock

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q '$(PIP_PIN)'

# The exact versions the suite last passed with (torch 2.13.0+cpu: the CPU wheel on disk), then ckv itself without
# resolving again. pyproject.toml keeps the ranges for `pip install ckv` into one's own environment.
$(STAMP): pyproject.toml $(LOCK) | $(BIN)/python
	$(BIN)/pip install -q -r $(LOCK)
	$(BIN)/pip install -q --no-deps -e .
	touch $(STAMP)

install: $(STAMP)

# pip-tools resolves with pip itself and pip's configuration, so the lock names the CPU torch wheel pip installs here
# (uv and poetry ignore that wheel and would lock a multi-GB CUDA build). Run make test-latest, then make test.
lock:  ## refresh requirements-dev.lock to the newest releases pyproject.toml allows (about 30 s), then reinstall
	$(PY) -m venv .venv-lock
	.venv-lock/bin/pip install -q '$(PIP_PIN)' '$(PIP_TOOLS_PIN)'
	.venv-lock/bin/pip-compile -q --upgrade --extra dev --allow-unsafe --strip-extras --no-emit-index-url \
		--no-emit-trusted-host --no-emit-find-links -o $(LOCK) pyproject.toml
	rm -f $(STAMP)
	$(MAKE) install

# Drift caught before users meet it: a separate environment with the newest releases that pyproject.toml allows,
# the fast suite there, and which packages differ from the lock and what failed (.ci/lock_drift.py).
test-latest:  ## the fast suite on the newest allowed releases, in .venv-latest (3 min 18 s on a fresh clone of 7e4302e, 2 idle cores, 2026-12-05: 2 min 30 s of pytest; docs/install.md)
	rm -rf .venv-latest
	$(PY) -m venv .venv-latest
	.venv-latest/bin/pip install -q --upgrade pip
	.venv-latest/bin/pip install -q --upgrade -e '.[dev]'
	.venv-latest/bin/python .ci/lock_drift.py --lock $(LOCK) -- -m "not slow" -q $(PYTEST_XDIST)

lint: $(STAMP)  ## ruff: lint and format check (seconds)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)  ## ruff: fix what is fixable and format the tree
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# pytest-xdist: one worker per core, at most 4, each on one thread (TEST_WORKERS=0: no workers, one process)
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); echo $$(( n < 4 ? n : 4 )))
PYTEST_XDIST := -n $(TEST_WORKERS) --dist worksteal

test: lint  ## the CI set: ruff, then the fast tests plus one end-to-end smoke run, on every core (pytest 4 min 12 s for 1,896 tests on a fresh clone of 786c181, 2 otherwise idle cores, 2026-12-06: `time make test` after `make install`, 4 min 16 s in all; e17e175's 1,683 tests took 4 min 38 s the same day: the machine is slower than on 2026-12-05)
	$(BIN)/python -m pytest -m "not slow" -q $(PYTEST_XDIST)

test-slow: $(STAMP)
	$(BIN)/python -m pytest -m slow -q

test-all: $(STAMP)
	$(BIN)/python -m pytest -q

demo: $(STAMP)  ## periodic weak spots on a CPU: three models at once, a full-attention control among them (4 min 20 s on 2 cores after the install, fresh clone 2026-12-02; 9 min 15 s on 2026-12-01: the machine varies; README)
	$(BIN)/python -m ckv.apps.demo --out outputs/demo

demo-grid: $(STAMP)  ## strides 2/4/8 x (W = S, W = 2S) x (gate, mean): 12 models, 1,000 steps (2,000 at S = 8), two at a time; names the models that did not learn (52 min 1 s on a fresh clone of 1458d6c, 2026-12-04, its first 33 min beside other jobs; about 30 min on 2 free cores at its last 19 min's pace: docs/demo.md)
	$(BIN)/python -m ckv.apps.demo --grid --out outputs/demo-grid

demo-v4: $(STAMP)  ## transformers' DeepSeek-V4 vs ckv's V4 variant vs the W = S = 4 gate vs full attention (~13 min on 2 cores; docs/demo.md)
	$(BIN)/python -m ckv.apps.demo_v4 --out outputs/demo-v4

robust: $(STAMP)  ## robustness benchmark: each task's baseline gate, DeepSeek-V4's compressor and full attention, seed 0: 6 runs (18 min 49 s on a fresh clone, 2 cores; docs/robustness.md)
	$(BIN)/python -m ckv.apps.robust --out outputs/robust

robust-confirm: $(STAMP)  ## confirmation on fresh seeds 100-102: V4's maps with and without mixing, the W4/S4 gate and full attention, 12 models (34 min 34 s on a fresh clone, 2 cores; criteria and results in docs/robustness.md)
	$(BIN)/python -m ckv.apps.robust --confirm --out outputs/robust_confirm

robust-ablation: $(STAMP)  ## ablation ladder W8/S4 gate -> deepseek_v4_csa on the split task, 8 steps x 2 seeds (about 50 min on 2 free cores by its last step's per-run time, 336-347 s of training side by side; 135 min measured with a pause and other jobs; trains its first step overlap_w8s4 too, or reuses it from the same --out)
	$(BIN)/python -m ckv.apps.robust --ablation --out outputs/robust

selection: $(STAMP)  ## does top-k selection create weak phases beyond the geometry? full control, V4 CSA dense and sparse (V3.2's stages, top-2 of 68 entries) served by indexer (fp32/FP8/FP4)/oracle/random/recency and a positive control, 3 seeds, 9 models (120 min 1 s on a fresh clone, 2 cores; undecided for both the trained indexer and the oracle; docs/selection.md)
	$(BIN)/python -m ckv.apps.selection --out outputs/selection

paper: $(STAMP)  ## the paper's controlled table at CPU scale: 26 models (23 compressed variants incl. 4 baseline seeds, 3 full-attention controls), each evaluated with prefix and in-sequence padding, beside the paper's numbers, with the claims (109 min 42 s on a fresh clone, 2 idle cores; resumes where it stopped)
	$(BIN)/python -m ckv.apps.study paper --out outputs/paper

mitigate: $(STAMP)  ## inference-time fixes of weak phases (shift ensembling, dual-offset compression) on make paper's 23 compressed models, 3 fresh baseline seeds and transformers' tiny DeepSeek-V4 (lookup and needle), paired against each model unmitigated, with the criteria committed in conf/study/mitigate.yaml (1 h 13 min on 2 cores after make paper, fresh clone; run make paper first: its models are reused, a missing one is trained by its own command; docs/mitigation.md)
	$(BIN)/python -m ckv.apps.study mitigate --out outputs/paper

pretrain: $(STAMP)  ## weak spots after pretraining, not task training: 10 models pretrained on the Bible with retrieval blocks in templates the evaluation never uses (2,000 steps each), scored on the held-out animal->name lookup beside 3 task-trained twins, with emergence over 8 checkpoints and the criteria committed in conf/study/pretrain.yaml (not yet timed whole: estimated 2.8-3.1 h on 2 cores from the first full run's log lines, at the 3 h aim, docs/pretrain.md; exits 1 when a claim FAILs)
	$(BIN)/python -m ckv.apps.study pretrain --out outputs/pretrain

csa2: $(STAMP)  ## which of DeepSeek-V4.1's choices shrinks the weak spots: its ratio-2 compressor, shared compressed KV, a full-resolution decoder: 7 variants of 4 layers (full attention, V4's W8/S4, V4.1's compressor at ratio 2 and 4, ratio 2 shared, the V4.1-style schedule with a ratio-1 and a ratio-2 decoder), 3 seeds each, make paper's regime and evaluation, paired differences and costs, criteria committed in conf/study/csa2.yaml (not yet run at full size; estimated 1.8-2.7 h on 2 idle cores from timed steps, docs/csa2.md)
	$(BIN)/python -m ckv.apps.study csa2 --out outputs/csa2

smoke: $(STAMP)  ## every attention variant: forward, backward, decode == prefill (seconds)
	$(BIN)/python -m ckv.apps.smoke

clean:
	rm -rf $(VENV) .venv-latest .venv-lock outputs multirun .pytest_cache
