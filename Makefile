# trainguard: `make demo` and `make test` work on a fresh clone (they set everything up).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup system demo test test-unit eval bench chaos clean

# The project's Python environment, rebuilt when pyproject.toml changes.
$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	# Integration tests train real (tiny) models with the real Trainer and TRL's GRPOTrainer and
	# write real TensorBoard files: CPU torch, pinned (trl's extra keeps transformers below 5).
	$(BIN)/python -m pip install --quiet torch==2.13.0 transformers==4.57.6 accelerate==1.15.0 tensorboard==2.21.0 trl==1.16.0
	# verl as its users install it beside other frameworks: the wheel without its GPU stack, plus
	# what `verl.utils.tracking` imports (its transformers-5 pin is not needed for that).
	$(BIN)/python -m pip install --quiet --no-deps verl==0.9.1
	$(BIN)/python -m pip install --quiet ray==2.60.0 "tensordict>=0.8,<=0.10.0" omegaconf==2.4.0 codetiming==1.4.0 msgpack==1.2.4 cloudpickle==3.1.3
	@touch $(STAMP)

setup: $(STAMP)

# Real Prometheus and Alertmanager for the sink tests (Debian packages).
system:
	bash scripts/setup-system.sh

demo: setup
	$(BIN)/trainguard demo

test: setup system
	$(BIN)/python -m pytest -q -p no:cacheprovider

test-unit: setup
	$(BIN)/python -m pytest -q -m "not integration"

eval: setup
	$(BIN)/python evaluation/run.py

bench: setup
	$(BIN)/python benchmarks/run.py

chaos: setup
	$(BIN)/python chaos/run.py

clean:
	rm -rf $(VENV) out .pytest_cache
