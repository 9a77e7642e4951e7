PYTHON ?= python3
# The set-up stamp lives in the environment it vouches for (its site-packages), not in the checkout: a fresh
# virtual environment always installs, whichever checkout it is used from.
SITE := $(shell $(PYTHON) -c "import sysconfig; print(sysconfig.get_path('purelib'))" 2>/dev/null)
ifeq ($(SITE),)
$(error "$(PYTHON)" does not run; set PYTHON to a Python >= 3.11)
endif
STAMP := $(SITE)/.qerl-setup.stamp

.PHONY: setup test demo bench bench-kernels bench-memory lint format clean

# Re-run the install only when the dependency list changes.
$(STAMP): pyproject.toml setup_env.sh
	PYTHON=$(PYTHON) bash setup_env.sh dev
	@touch $(STAMP)

setup: $(STAMP)

LINTED := qerl tests benchmarks eval experiments llm-compressor

# CI runs `make test`: the formatter's check runs there too (seconds), so unformatted code does not land.
test: $(STAMP)
	$(PYTHON) -m ruff format --check $(LINTED)
	$(PYTHON) -m pytest -q

demo: $(STAMP)
	$(PYTHON) -m qerl.demo

bench-kernels: $(STAMP)
	$(PYTHON) -m benchmarks.probes.nvfp4_speed

bench-memory: $(STAMP)
	$(PYTHON) -m benchmarks.load_memory

bench: bench-kernels bench-memory

lint: $(STAMP)
	$(PYTHON) -m ruff check $(LINTED)
	$(PYTHON) -m ruff format --check $(LINTED)

format: $(STAMP)
	$(PYTHON) -m ruff format $(LINTED)
	$(PYTHON) -m ruff check --fix $(LINTED)

clean:
	rm -rf $(STAMP) runs .pytest_cache
