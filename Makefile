# `make repro` runs the pipeline (`make repro-full` the full grid, without DVC, in run-full/),
# `make exp ARGS="-S key=value"` one DVC experiment, `make test` the tests (`make test-fast` those not marked
# slow), `make lint` the formatter and linter; all create or update .venv first. The stages run `python`: .venv's bin goes first on PATH so it is the one with torch.
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin

.PHONY: install repro repro-full exp test test-fast lint ui clean-stores

$(BIN)/.installed: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -r requirements.txt
	touch $@

install: $(BIN)/.installed

repro: $(BIN)/.installed
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/dvc repro

repro-full: $(BIN)/.installed  # presets/full-cpu.yaml: params.yaml's grid with oneDNN off and batch 1 too
	$(BIN)/python -m pipeline.run --params presets/full-cpu.yaml --workdir run-full

exp: $(BIN)/.installed  # ARGS: options of dvc exp run, e.g. ARGS="-S 'sweep.space.batch_size=[4]'"
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/dvc exp run $(ARGS)

test: $(BIN)/.installed
	$(BIN)/python -m pytest

test-fast: $(BIN)/.installed
	$(BIN)/python -m pytest -m "not slow"

lint: $(BIN)/.installed  # the layout ruff format gives, and ruff check's rules (pyproject.toml)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

ui: $(BIN)/.installed
	$(BIN)/mlflow ui --host 127.0.0.1 --backend-store-uri sqlite:///mlflow.db  # this machine only: no authentication

clean-stores:  # the MLflow database and the Optuna journal: every measurement they hold is lost
	rm -f mlflow.db optuna.journal*
	rm -rf mlruns mlartifacts
