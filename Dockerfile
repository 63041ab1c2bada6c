# The tracegym image: gateway, embedded engine, trainer and runner in one (docs/compose.md).
#
#   docker build -t tracegym:latest .                      # python:3.11-slim, PyPI's torch (CUDA build)
#   bash scripts/docker_images.sh                          # what docker-compose.yml needs, built here
#
# Build arguments:
#   BASE_IMAGE      a Debian-like image with Python 3.11+ (python3 -m venv, ca-certificates); default
#                   python:3.11-slim; scripts/docker_images.sh makes one from Debian's packages where no
#                   image registry answers
#   TORCH_SPEC      default torch==2.13.0 (PyPI's Linux build is the CUDA one); for a CPU-only image pass
#                   TORCH_SPEC="torch==2.13.0+cpu" PIP_EXTRA="--extra-index-url <a CPU wheel index>", or
#                   put the CPU wheel in deploy/docker/extra/wheels/
#   PIP_EXTRA       more pip options for every install (an index, a proxy)
#   PRELOAD_MODELS  model names prepared into /cache at build time (e.g. "smollm2-135m"): a new `cache`
#                   volume starts with them, so the containers need no download at start
# deploy/docker/extra/ may hold ca.crt (an extra CA bundle, for networks that intercept TLS: trusted by
# pip at build time and by the image's programs at run time) and wheels/ (pip --find-links); it is copied
# only into the build stages, so the wheels do not end up in the image.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS base
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH TRACEGYM_CACHE=/cache \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt \
    REQUESTS_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt \
    RAY_USAGE_STATS_ENABLED=0 HF_HUB_DISABLE_TELEMETRY=1
COPY deploy/docker/extra/README.md deploy/docker/extra/ca.cr[t] /tmp/extra/
RUN set -eu; \
    if ! command -v curl >/dev/null; then \
      apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends curl ca-certificates \
      && rm -rf /var/lib/apt/lists/*; \
    fi; \
    if [ -s /tmp/extra/ca.crt ]; then cat /tmp/extra/ca.crt >>/etc/ssl/certs/ca-certificates.crt; fi; \
    rm -rf /tmp/extra

# The dependencies pyproject.toml lists, extracted in a stage of their own: the virtualenv below is built
# again only when they change, not whenever pyproject.toml does.
FROM base AS requirements
COPY pyproject.toml /tmp/pyproject.toml
RUN python3 -c 'import tomllib; p = tomllib.load(open("/tmp/pyproject.toml", "rb"))["project"]; x = p["optional-dependencies"]; print("\n".join(p["dependencies"] + x["gateway"] + x["trainer"] + x["examples"]))' >/tmp/requirements.txt

# The virtualenv: torch, then every dependency.
FROM base AS venv
ARG TORCH_SPEC="torch==2.13.0"
ARG PIP_EXTRA=""
COPY deploy/docker/extra/ /tmp/extra/
RUN python3 -m venv /opt/venv \
 && pip install -q --find-links /tmp/extra/wheels $PIP_EXTRA "$TORCH_SPEC" setuptools wheel
COPY --from=requirements /tmp/requirements.txt /tmp/requirements.txt
RUN pip install -q --find-links /tmp/extra/wheels $PIP_EXTRA -r /tmp/requirements.txt "$TORCH_SPEC"

# Models prepared at build time (none by default): tracegym's model code alone, on the path.
FROM venv AS models
ARG PRELOAD_MODELS=""
COPY sdk /tmp/tg/tracegym
COPY modelfiles /tmp/tg/tracegym/modelfiles
RUN mkdir -p /cache \
 && for m in $PRELOAD_MODELS; do \
      HF_HUB_OFFLINE=1 PYTHONPATH=/tmp/tg python3 -c 'import sys; from tracegym.modelfiles.prepare import prepare_model; print(prepare_model(sys.argv[1]))' "$m" || exit 1; \
    done \
 && rm -rf /cache/downloads

FROM base
COPY --from=venv /opt/venv /opt/venv
COPY --from=models /cache /cache
WORKDIR /app
COPY pyproject.toml README.md ./
COPY sdk ./sdk
COPY gateway ./gateway
COPY trainer ./trainer
COPY engine ./engine
COPY modelfiles ./modelfiles
RUN pip install -q --no-deps --no-build-isolation -e . && tracegym --version
COPY examples ./examples
COPY deploy/docker/bin/ /usr/local/bin/
VOLUME ["/cache", "/weights"]
ENTRYPOINT ["tracegym"]
CMD ["--help"]
