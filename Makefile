# trainguard: `make demo` and `make test` work on a fresh clone (they set everything up).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
FRAMEWORKS := $(VENV)/.frameworks

.PHONY: setup frameworks system kafka demo test test-unit lint eval bench scale chaos clean

# The project's Python environment, rebuilt when pyproject.toml changes: what the demo,
# the evaluation, the benchmarks and chaos need (worker, node agent, embedded broker, test tools).
$(STAMP): pyproject.toml
	@echo "setup: the Python environment in $(VENV) (trainguard, Faust, confluent-kafka, the embedded broker)"
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/python -m pip install --quiet --upgrade pip
	@$(BIN)/python -m pip install --quiet -e '.[dev]'
	@touch $(STAMP)

# The frameworks the integration tests train real (tiny) models with: the real Trainer, TRL's
# GRPOTrainer, real TensorBoard, W&B and SwanLab files (replay reads them; both libraries write
# offline) (torch pinned: PyPI's Linux wheel, which brings its CUDA libraries, about 4 GB, and
# runs on the CPU where there is no GPU; trl's extra keeps transformers below 5), and verl as its
# users install it beside other frameworks: the wheel without its GPU
# stack, plus what `verl.utils.tracking` imports (its transformers-5 pin is not needed for that).
$(FRAMEWORKS): $(STAMP)
	@echo "setup: the frameworks the tests train with (torch, transformers, TRL, W&B, SwanLab, verl; about 4 GB, a few minutes once)"
	@$(BIN)/python -m pip install --quiet torch==2.13.0 transformers==4.57.6 accelerate==1.15.0 tensorboard==2.21.0 trl==1.16.0
	@$(BIN)/python -m pip install --quiet wandb==0.31.0 swanlab==0.10.3
	@$(BIN)/python -m pip install --quiet --no-deps verl==0.9.1
	@$(BIN)/python -m pip install --quiet ray==2.60.0 "tensordict>=0.8,<=0.10.0" omegaconf==2.4.0 codetiming==1.4.0 msgpack==1.2.4 cloudpickle==3.1.3
	@# what verl's own TaskRunnerV1 and v1 trainers import (the wiring is checked against them), without their deps
	@$(BIN)/python -m pip install --quiet --no-deps hydra-core==1.3.2 antlr4-python3-runtime==4.9.3 torchdata==0.11.0 \
		TransferQueue==0.1.11 msgspec==0.23.0 pyzmq==27.3.0 cachetools==8.0.2 peft==0.21.2 pylatexenc==2.11 \
		uvicorn==0.54.0 fastapi==0.165.0 starlette==1.10.0 annotated-doc==0.0.7
	@touch $(FRAMEWORKS)

setup: $(STAMP)

frameworks: $(FRAMEWORKS)

# Apache Kafka's broker (KRaft) for the integration tests: the release pinned in
# deploy/kafka/pom.xml and its runtime jars, resolved with Maven (cached in ~/.m2) into .kafka/lib.
KAFKA_LIB := .kafka/lib
$(KAFKA_LIB)/.resolved: deploy/kafka/pom.xml
	@echo "setup: Apache Kafka's broker jars with Maven into $(KAFKA_LIB) (once; needs Java 17 and mvn)"
	@command -v mvn >/dev/null || { echo "make kafka: Maven (mvn) is not installed: apt-get install maven" >&2; exit 1; }
	@rm -rf $(KAFKA_LIB)
	@mkdir -p $(KAFKA_LIB)
	@mvn -q -B -f deploy/kafka/pom.xml dependency:copy-dependencies -DoutputDirectory=$(CURDIR)/$(KAFKA_LIB) \
		> $(KAFKA_LIB)/maven.log 2>&1 || { cat $(KAFKA_LIB)/maven.log; exit 1; }  # quiet unless it fails
	@touch $@

kafka: $(KAFKA_LIB)/.resolved

# Real Prometheus and Alertmanager for the sink tests (Debian packages).
system:
	bash scripts/setup-system.sh

# Its summary gives the whole wall time too, the setup included (seconds_with_setup).
demo:
	@start=$$(date +%s); $(MAKE) --no-print-directory setup && TRAINGUARD_DEMO_SETUP_STARTED=$$start $(BIN)/trainguard demo

# Three test processes on two cores (most tests wait on brokers and timers), a file to each so that
# a module's broker and worker stay with it; the 15 slowest tests printed at the end.
test: setup frameworks system kafka
	$(BIN)/python -m pytest -q -p no:cacheprovider -n 3 --dist loadfile --durations=15

test-unit: setup frameworks
	$(BIN)/python -m pytest -q -m "not integration"

# ruff over every package, the tests and the tools; mypy over every package of the product.
lint: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/test_lint.py tests/test_types.py

eval: setup
	$(BIN)/python evaluation/run.py

# Every figure on Tansu and on Apache Kafka, the fleet and the hot run too (docs/performance.md).
bench: setup kafka
	$(BIN)/python benchmarks/run.py

# The fleet (1, 2, 4 workers on 32 partitions of Apache Kafka) and the hot run alone; --quick: small.
scale: setup kafka
	$(BIN)/python benchmarks/fleet.py

# Faults on a three-node Apache Kafka cluster (the embedded broker for the scenarios that restart
# it themselves): docs/reliability.md. CHAOS_ARGS: e.g. --quick, --only broker_kill,election.
chaos: setup kafka
	$(BIN)/python chaos/run.py $(CHAOS_ARGS)

clean:
	rm -rf $(VENV) out .pytest_cache
