# Two commands do all the set-up: `make demo` trains the default MNIST model, `make test` runs the suite.
# Each creates .venv, installs torch==2.13.0 first when that build is available (the CPU build on
# the dev machines; elsewhere whatever `torch>=2.4` resolves to), then brickyard itself. `make demo`
# installs what a run needs and no more (brickyard and TensorBoard, the [viz] extra, for the events every
# run writes); `make test`, `test-fast` and `lint` add the suite's own: pytest, ruff and mypy (the [test]
# extra) and the integrations its tests cover (ONNX, MLflow, W&B, Hugging Face datasets), each of which
# may fail to install and leaves its tests skipping.
VENV   ?= .venv
PY     := $(VENV)/bin/python
SHARED := $(abspath ../shared/datasets)
export BRICKYARD_DATA ?= $(if $(wildcard $(SHARED)/mnist),$(SHARED),)

.PHONY: demo test test-fast lint bench clean

$(VENV)/.installed: pyproject.toml  ## what a run needs: torch, brickyard, TensorBoard
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0 || $(PY) -m pip install -q "torch>=2.4"
	$(PY) -m pip install -q -e '.[viz]'
	touch $@

$(VENV)/.test-installed: $(VENV)/.installed  ## and what the suite and the linters need
	$(PY) -m pip install -q -e '.[test,viz]'
	$(PY) -m pip install -q -e '.[onnx]' || echo "the [onnx] extra could not be installed: the ONNX tests will skip"
	$(PY) -m pip install -q -e '.[mlflow,wandb]' || echo "the [mlflow,wandb] extras could not be installed: the tracker tests will skip"
	$(PY) -m pip install -q -e '.[hf]' || echo "the [hf] extra (Hugging Face datasets) could not be installed: its tests will skip"
	$(PY) -m pip install -q -e '.[ray]' || echo "the [ray] extra (Ray Train) could not be installed: its test will skip"
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/brickyard train

test: $(VENV)/.test-installed  ## the suite, on one worker process a core (at most 4: tests/conftest.py)
	$(PY) -m pytest -q -n auto --dist worksteal --durations=15

test-fast: $(VENV)/.test-installed  ## the unit tier (tests marked fast: no subprocess, no process group), in under 3 minutes on 2 cores
	$(PY) -m pytest -q -m fast -n auto --dist worksteal --durations=10

lint: $(VENV)/.test-installed  ## ruff and mypy, as pyproject.toml configures them
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

bench: $(VENV)/.installed  ## overhead, time to 99% and the course recipe (docs/benchmarks.md), about 8 minutes on 2 cores
	$(PY) benchmarks/overhead.py
	$(PY) benchmarks/time_to_accuracy.py
	$(PY) benchmarks/course_recipe.py

clean:
	rm -rf $(VENV) runs .pytest_cache
