# `make repro` runs the pipeline, `make test` the tests; both create or update .venv first.
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin

.PHONY: install repro test ui clean-stores

$(BIN)/.installed: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -r requirements.txt
	touch $@

install: $(BIN)/.installed

repro: $(BIN)/.installed
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/dvc repro

test: $(BIN)/.installed
	$(BIN)/python -m pytest

ui: $(BIN)/.installed
	$(BIN)/mlflow ui --host 127.0.0.1 --backend-store-uri sqlite:///mlflow.db  # this machine only: no authentication

clean-stores:  # the MLflow database and the Optuna journal: every measurement they hold is lost
	rm -f mlflow.db optuna.journal*
	rm -rf mlruns mlartifacts
