# Quick start: `make demo` (tune the bundled Llama-2 7B example) and `make test`.
# Both create .venv first (scripts/bootstrap.sh): the CPU stack pinned for Python 3.11.
VENV ?= .venv
MH := $(VENV)/bin/megatron-hetero

.PHONY: venv demo test bench
venv:
	@scripts/bootstrap.sh

demo: venv
	$(MH) validate examples/llama2/7b/plan.yaml
	$(MH) args examples/llama2/7b/plan.yaml

test: venv
	$(VENV)/bin/python -m pytest -q tests
