# Every target sets itself up from nothing: a fresh clone needs only python3.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU torch wheel (fast, local on the dev/CI machines). A bare "torch" would
# pull a multi-GB CUDA build.
TORCH_CPU ?= torch==2.13.0

.PHONY: test sim demo test-gpu bench bench-tp serve-deps-offline clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# --no-compile: pip byte-compiles all of site-packages on one core (torch's install took
# 35 s with it, 9 without). Each module is compiled instead when a process first imports
# it, and its byte-code kept for the next: these machines set PYTHONDONTWRITEBYTECODE=1,
# with which every one of the many test processes (TP ranks, engine processes, servers)
# would compile torch's and transformers' imports again (3 s each), so the targets run
# with it unset. Measured: the imports the tests make compile in 10 s, once; compileall
# of torch, transformers, triton and sympy (the previous setup) took 24 s on 2 cores.
export PYTHONDONTWRITEBYTECODE :=

# Engine + simulator only: numpy and xxhash, no torch.
$(VENV)/.core: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	touch $@

# One pip run for torch and the rest: 37 s where two took 16 + 31 (the pinned CPU wheel is
# still the one chosen).
$(VENV)/.full: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q --no-compile $(TORCH_CPU) -e '.[model,dev,serve,plot]'
	touch $@ $(VENV)/.core

# Coverage is measured where it is enforced (the engine and the simulator), by the tests
# of those two (ENGINE_TESTS, under the tracer); the model, kernel, server and TP tests
# run after, untraced (tracing them cost ~40 s of the 5-minute budget and added nothing).
ENGINE_TESTS := $(addprefix tests/test_,async_engine.py block_manager.py config.py differential.py \
	engine.py engine_host_path.py fake_executor.py golden_traces.py inputs.py no_torch.py \
	parallel_samples.py plots.py record_trace.py sim.py sim_oracle.py sim_traces.py)
test: $(VENV)/.full
	$(BIN)/python -m pytest -n 2 --dist worksteal -q --cov=minivllm/engine --cov=sim --cov-report=term-missing:skip-covered $(ENGINE_TESTS)
	$(BIN)/python -m coverage report --include='minivllm/engine/*,sim/*' --skip-covered --fail-under=90
	$(BIN)/python -m pytest -n 2 --dist worksteal -q tests $(addprefix --ignore=,$(ENGINE_TESTS))

sim: $(VENV)/.core
	$(BIN)/python -m sim run --traces 10000 --seed 0

demo: $(VENV)/.full
	$(BIN)/python -m minivllm generate --model fixtures/tiny-qwen3 --temperature 0 --max-tokens 8 \
		"12+34=" "50+27=" "8+81=" "66+19=" "45+45="

# Needs a CUDA device; runs from the tree (the GPU machine has its packages preinstalled).
# One process per file: each engine sizes its KV pool from the memory free in its
# process, which the kernel tests' allocations would otherwise distort.
# TESTS_GPU="model tp" runs a subset (the part after tests_gpu/test_). With pytest-timeout
# installed (the GPU machine has it), a test past GPU_TEST_TIMEOUT seconds (default 400)
# ends its file's run with every thread's stack, instead of hanging the whole call.
TESTS_GPU ?= kernels model families sampling_features bf16_accuracy tp
test-gpu:
	@rc=0; for f in $(TESTS_GPU); do \
	  echo "=== tests_gpu/test_$$f*.py"; \
	  PYTHONPATH=. python3 -m pytest -q -rs -o timeout=$(or $(GPU_TEST_TIMEOUT),400) -o timeout_method=thread \
	    tests_gpu/test_$${f}*.py || rc=1; \
	done; exit $$rc

# Needs a CUDA device; one process per benchmark (each sizes GPU memory for itself),
# each under a time limit (BENCH_TIMEOUT seconds, default 240). A failing one does
# not stop the rest; the target fails at the end if any did. With OUT set, each
# writes $(OUT)/<name>.json. BENCH_QUICK=1: fewer requests, async on only.
bench: serve-deps-offline
	@rc=0; \
	run() { echo "=== $$*"; PYTHONPATH=. timeout $(or $(BENCH_TIMEOUT),240) python3 -m "$$@" \
	        || { echo "=== FAILED (exit $$?): $$*"; rc=1; }; }; \
	run benchmarks.throughput $(if $(BENCH_QUICK),--num-requests 128 --hf-requests 16 --async on); \
	run benchmarks.serving $(if $(BENCH_QUICK),--num-requests 128 --max-duration 8); \
	run benchmarks.host_overlap $(if $(BENCH_QUICK),--async on); \
	run benchmarks.step_timeline $(if $(BENCH_QUICK),--num-requests 128); \
	run benchmarks.launch_overhead; \
	run benchmarks.kernel_count $(if $(BENCH_QUICK),--async on); \
	run benchmarks.long_context $(if $(BENCH_QUICK),--repeats 2); \
	if [ -f benchmarks/prefill_attention.py ]; then run benchmarks.prefill_attention --quick; fi; \
	if [ -f benchmarks/decode_attention.py ]; then run benchmarks.decode_attention; fi; \
	if [ -f benchmarks/sampler.py ]; then run benchmarks.sampler; fi; \
	run benchmarks.gemv $(if $(BENCH_QUICK),--quick); \
	exit $$rc

# Needs two CUDA devices: Qwen3-8B shapes (random bf16 weights, written once to $(CK8)),
# TP=1 and TP=2 in alternating pairs, one process per run (benchmarks/tp_scaling.py):
# issue 8's throughput and batch-1 ratios beside their goals. TP2_VARIANTS adds TP=2 runs
# with other options to every round, e.g.
#   make bench-tp TP2_VARIANTS="--tp2-variant 'push=--push-all-reduce on' --tp2-variant 'warm=MINIVLLM_PDL=1 MINIVLLM_AR_WARM_MB=16'"
CK8 ?= /tmp/minivllm-qwen3-8b
bench-tp:
	PYTHONPATH=. python3 -c 'from benchmarks.qwen3_shapes import write_random_checkpoint as w; w("$(CK8)", "qwen3-8b")'
	PYTHONPATH=. python3 -m benchmarks.tp_scaling --pairs $(or $(TP_PAIRS),2) --shapes qwen3-8b --model-dir $(CK8) $(TP2_VARIANTS)

# The GPU machine has no network: install the server's packages from wheels carried in
# .wheels/ (downloaded where there is network; README "Serving"). A no-op when present.
SERVE_PKGS := fastapi uvicorn pydantic httpx prometheus_client
serve-deps-offline:
	@python3 -c "import fastapi, uvicorn, pydantic, httpx, prometheus_client" 2>/dev/null \
	  || python3 -m pip install -q --no-index --find-links .wheels $(SERVE_PKGS)

clean:
	rm -rf $(VENV) .pytest_cache .coverage
