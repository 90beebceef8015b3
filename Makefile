# Quick start: `make demo` (tune the bundled Llama-2 7B example) and `make test`.
# Both create .venv first (scripts/bootstrap.sh): the CPU stack pinned for Python 3.11
# (megatron-core 0.19.2 the venv's own; 0.17.1, the oldest supported, beside it for the tests).
VENV ?= .venv
MH := $(VENV)/bin/megatron-hetero

.PHONY: venv demo test bench
venv:
	@scripts/bootstrap.sh

demo: venv
	@mkdir -p out
	$(MH) tune examples/llama2/7b/inventory.yaml --model llama2-7b --global-batch-size 128 \
	  --seq-length 4096 -o out/plan.yaml --report out/report.json --timeline out/timeline.png
	$(MH) args out/plan.yaml

test: venv
	$(VENV)/bin/python -m pytest -q tests

# Benchmarks: figures measured side by side in one run each (minutes on 2 cores).
bench: venv
	$(VENV)/bin/python scripts/bench_tuner.py
	$(VENV)/bin/python scripts/bench_vendors.py
	$(VENV)/bin/python scripts/bench_batch_scaling.py
	$(VENV)/bin/python scripts/bench_warmup.py
	$(VENV)/bin/python scripts/bench_meshes.py
	$(VENV)/bin/python scripts/bench_moe.py --large
	$(VENV)/bin/python scripts/bench_efficiency.py
	$(VENV)/bin/python scripts/bench_rehearse.py
	$(VENV)/bin/python scripts/bench_runtime_overhead.py
	$(VENV)/bin/python scripts/bench_recovery.py
	$(VENV)/bin/python scripts/bench_telemetry.py
	$(VENV)/bin/python scripts/bench_rebalance.py
	$(VENV)/bin/python scripts/bench_rebalance.py --mode megatron
	$(VENV)/bin/python scripts/bench_mesh_rehearse.py
