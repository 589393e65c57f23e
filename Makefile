# Two commands do all the set-up: `make demo` trains the default MNIST model, `make test` runs the suite.
# Each creates .venv, installs torch==2.13.0 first when that build is available (the CPU build on
# the dev machines; elsewhere whatever `torch>=2.4` resolves to), then brickyard itself.
VENV   ?= .venv
PY     := $(VENV)/bin/python
SHARED := $(abspath ../shared/datasets)
export BRICKYARD_DATA ?= $(if $(wildcard $(SHARED)/mnist),$(SHARED),)

.PHONY: demo test bench clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0 || $(PY) -m pip install -q "torch>=2.4"
	$(PY) -m pip install -q -e '.[test,viz]'
	$(PY) -m pip install -q -e '.[onnx]' || echo "the [onnx] extra could not be installed: the ONNX tests will skip"
	$(PY) -m pip install -q -e '.[mlflow,wandb]' || echo "the [mlflow,wandb] extras could not be installed: the tracker tests will skip"
	$(PY) -m pip install -q -e '.[hf]' || echo "the [hf] extra (Hugging Face datasets) could not be installed: its tests will skip"
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/brickyard train

test: $(VENV)/.installed  ## the suite, on one worker process a core (at most 4: tests/conftest.py)
	$(PY) -m pytest -q -n auto --dist worksteal --durations=15

bench: $(VENV)/.installed  ## overhead, time to 99% and the course recipe (docs/benchmarks.md), about 8 minutes on 2 cores
	$(PY) benchmarks/overhead.py
	$(PY) benchmarks/time_to_accuracy.py
	$(PY) benchmarks/course_recipe.py

clean:
	rm -rf $(VENV) runs .pytest_cache
