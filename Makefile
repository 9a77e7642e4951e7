PYTHON ?= python3
# The set-up stamp lives in the environment it vouches for (its site-packages), not in the checkout: a fresh
# virtual environment always installs, whichever checkout it is used from.
SITE := $(shell $(PYTHON) -c "import sysconfig; print(sysconfig.get_path('purelib'))" 2>/dev/null)
ifeq ($(SITE),)
$(error "$(PYTHON)" does not run; set PYTHON to a Python >= 3.11)
endif
STAMP := $(SITE)/.qerl-setup.stamp

.PHONY: setup test demo bench bench-kernels bench-memory lint clean

# Re-run the install only when the dependency list changes.
$(STAMP): pyproject.toml setup_env.sh
	PYTHON=$(PYTHON) bash setup_env.sh dev
	@touch $(STAMP)

setup: $(STAMP)

test: $(STAMP)
	$(PYTHON) -m pytest -q

demo: $(STAMP)
	$(PYTHON) -m qerl.demo

bench-kernels: $(STAMP)
	$(PYTHON) -m benchmarks.kernels

bench-memory: $(STAMP)
	$(PYTHON) -m benchmarks.load_memory

bench: bench-kernels bench-memory

lint: $(STAMP)
	$(PYTHON) -m ruff check qerl tests benchmarks eval experiments llm-compressor

clean:
	rm -rf $(STAMP) runs .pytest_cache
