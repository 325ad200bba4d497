# syntax=docker/dockerfile:1
#
# Ballast image. One Dockerfile, two flavours selected by a build argument:
#   default            torch from PyPI, which ships the CUDA wheels  -> GPU image (executor)
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu            -> CPU image (everything else)
# compose.yaml builds both. `docker run IMAGE` prints the CLI help.

ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build

# Must equal the torch pin in pyproject.toml (tests/cli/test_compose.py checks this).
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH

RUN python -m venv /opt/venv

# torch first, in its own layer: it is by far the largest download and rarely changes, so source edits
# do not re-fetch it. With an index URL (the CPU flavour) the local "+cpu" build satisfies the plain
# `torch==X` pin, so the `pip install .` below keeps it instead of pulling the CUDA wheels.
RUN pip install ${TORCH_INDEX_URL:+--index-url $TORCH_INDEX_URL} "torch==${TORCH_VERSION}"

WORKDIR /src
COPY . .
RUN pip install . && ballast --help >/dev/null


FROM ${PYTHON_IMAGE}

ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    BALLAST_HOST=0.0.0.0 \
    BALLAST_DATA_DIR=/var/lib/ballast

# Fixed numeric ids so volume ownership is stable across rebuilds and orchestrators can verify
# runAsNonRoot. The data dir exists in the image with the right owner, so a fresh named volume
# mounted there inherits that ownership.
RUN groupadd --system --gid 10001 ballast \
 && useradd --system --uid 10001 --gid ballast --home-dir /var/lib/ballast --no-create-home \
        --shell /usr/sbin/nologin ballast \
 && install -d -o ballast -g ballast -m 0750 /var/lib/ballast

# Same base image in both stages, so the venv's interpreter symlinks stay valid.
COPY --from=build /opt/venv /opt/venv

USER 10001:10001
WORKDIR /var/lib/ballast

CMD ["ballast", "--help"]
