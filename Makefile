PYTHON ?= python3
STAMP := .setup.stamp

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
	$(PYTHON) -m ruff check qerl tests benchmarks eval llm-compressor

clean:
	rm -rf $(STAMP) runs .pytest_cache
