# The tracegym image: gateway, embedded engine, trainer and runner in one.
# GPU hosts get PyPI's default (CUDA) torch; for a CPU-only image pass
#   --build-arg TORCH_SPEC="torch==2.13.0+cpu" --build-arg PIP_EXTRA="--extra-index-url <your CPU wheel index>"
FROM python:3.11-slim

ARG TORCH_SPEC="torch==2.13.0"
ARG PIP_EXTRA=""
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 TRACEGYM_CACHE=/cache

RUN apt-get update && apt-get install -y --no-install-recommends curl && rm -rf /var/lib/apt/lists/*
WORKDIR /app
RUN pip install $PIP_EXTRA "$TORCH_SPEC"
COPY pyproject.toml README.md ./
COPY sdk ./sdk
COPY gateway ./gateway
COPY trainer ./trainer
RUN pip install $PIP_EXTRA -e '.[all]'
COPY examples ./examples
VOLUME ["/cache", "/weights"]
ENTRYPOINT ["tracegym"]
CMD ["--help"]
