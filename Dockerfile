# Gyre's image: every service is `gyre serve <service>` in this one image.
#
#   docker build -t gyre:local .                                  # CPU (embedded engine, CPU trainer)
#   docker build -t gyre:cuda --build-arg VARIANT=cuda .          # CUDA: + SGLang, megatron-core
#
# Build arguments (all optional):
#   VARIANT                 cpu | cuda
#   PYTHON_IMAGE            base of the CPU variant (Python 3.11, as the pins in requirements/ expect)
#   CUDA_IMAGE              base of the CUDA variant; its CUDA must suit the torch build that pip picks
#   TORCH_INDEX_URL         a package index holding the CPU build of the pinned torch; empty = the
#                           default index (whose Linux wheels carry CUDA libraries: larger, still runs on CPU)
#   SGLANG_VERSION, MEGATRON_CORE_VERSION
#                           CUDA variant only: the versions Gyre's adapters were checked against
#
# Python dependencies come from requirements.txt and requirements/*.txt, installed exactly as
# the Makefile does (requirements/nodeps.txt with --no-deps). The service runs as the non-root
# user `gyre` (uid 10001); `gyre-healthcheck [PORT]` asks its /health (default port 8080).

ARG VARIANT=cpu
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG CUDA_IMAGE=nvidia/cuda:12.9.1-cudnn-devel-ubuntu22.04

# ---- bases: one per variant; the build and runtime stages start from base-${VARIANT} ----
FROM ${PYTHON_IMAGE} AS base-cpu
RUN apt-get update \
 && apt-get install -y --no-install-recommends tini ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && ln -sf "$(command -v python3)" /usr/local/bin/gyre-python

FROM ${CUDA_IMAGE} AS base-cuda
# Ubuntu 22.04 carries Python 3.11 in universe; SGLang's kernels compile with the toolkit's nvcc.
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      python3.11 python3.11-venv python3.11-dev build-essential tini ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && ln -sf /usr/bin/python3.11 /usr/local/bin/gyre-python

# ---- build: a virtual environment under /opt/gyre with the pinned requirements and Gyre ----
FROM base-${VARIANT} AS build
ARG VARIANT
ARG TORCH_INDEX_URL=""
ARG SGLANG_VERSION=0.5.23
ARG MEGATRON_CORE_VERSION=0.16.1
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
RUN gyre-python -m venv /opt/gyre
COPY requirements.txt ./
COPY requirements ./requirements
RUN if [ -n "$TORCH_INDEX_URL" ]; then \
      /opt/gyre/bin/pip install --index-url "$TORCH_INDEX_URL" "$(grep -E '^torch==' requirements/torch.txt)"; \
    fi \
 && /opt/gyre/bin/pip install -r requirements.txt \
 && /opt/gyre/bin/pip install --no-deps -r requirements/nodeps.txt
# The CUDA extras must not move any pin above: the constraint makes a conflict fail the build.
RUN if [ "$VARIANT" = "cuda" ]; then \
      /opt/gyre/bin/pip freeze --exclude-editable > /tmp/pinned.txt \
      && /opt/gyre/bin/pip install --constraint /tmp/pinned.txt \
           "sglang==${SGLANG_VERSION}" "megatron-core==${MEGATRON_CORE_VERSION}"; \
    fi
COPY pyproject.toml README.md ./
COPY gyre ./gyre
COPY libs ./libs
COPY services ./services
RUN /opt/gyre/bin/pip install --no-deps . \
 && /opt/gyre/bin/gyre serve --list
COPY deploy/docker/healthcheck.py /opt/gyre/bin/gyre-healthcheck
RUN sed -i '1s|.*|#!/opt/gyre/bin/python|' /opt/gyre/bin/gyre-healthcheck && chmod 0755 /opt/gyre/bin/gyre-healthcheck

# ---- runtime ----
FROM base-${VARIANT} AS runtime
ARG VARIANT
LABEL org.opencontainers.image.title="gyre" \
      org.opencontainers.image.description="Gyre services (gyre serve <service>)" \
      org.opencontainers.image.licenses="Apache-2.0" \
      io.gyre.variant="${VARIANT}"
RUN groupadd --system --gid 10001 gyre \
 && useradd --system --uid 10001 --gid gyre --home-dir /home/gyre --create-home --shell /usr/sbin/nologin gyre \
 && install -d -o gyre -g gyre -m 0750 /var/lib/gyre /var/cache/gyre \
 && install -d -o root -g root -m 0755 /srv/gyre/tasks
COPY --from=build /opt/gyre /opt/gyre
# Named volumes mounted on /var/lib/gyre and /var/cache/gyre start with this ownership; the
# evaluator's task set is mounted on /srv/gyre/tasks (docker-compose.yml, the Helm chart).
ENV PATH=/opt/gyre/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    GYRE_HOST=0.0.0.0 \
    GYRE_RUN_DIR=/var/lib/gyre \
    GYRE_CACHE_DIR=/var/cache/gyre \
    GYRE_EVALUATOR_TASKS_DIR=/srv/gyre/tasks \
    GYRE_LOG_JSON=true
USER 10001:10001
WORKDIR /var/lib/gyre
EXPOSE 8080
# Every service serves /health on its --port; 8080 is the port the deployments give it.
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s --retries=3 CMD ["gyre-healthcheck"]
# tini forwards SIGTERM to gyre, which stops its service cleanly, and reaps sandbox children.
ENTRYPOINT ["tini", "--"]
CMD ["gyre", "serve", "--list"]
