#!/usr/bin/env bash
# Builds every image docker-compose.yml needs (docs/compose.md):
#   tracegym:latest            gateway, embedded engine, trainer, runner (the Dockerfile)
#   and the base images: python:3.11-slim and postgres:16 pulled where an image registry answers, else
#   made here from Debian's packages:
#   tracegym/debian-python:bookworm   debootstrap (python3, python3-venv, ca-certificates, curl)
#   tracegym/postgres:debian          Debian's PostgreSQL behind the official image's entrypoint contract
# The last line says which base was used and what to export for docker-compose.
#
# Settings (environment):
#   TRACEGYM_BASE=auto|pull|debian  auto (default): pull, and build from Debian where pulling fails
#   TRACEGYM_PRELOAD_MODELS         models prepared into the image's /cache (default "smollm2-135m tiny-random")
#   TRACEGYM_TORCH_SPEC             default torch==2.13.0 (PyPI's Linux wheel is the CUDA build; a CPU wheel
#                                   in TRACEGYM_WHEELS or an index in TRACEGYM_PIP_EXTRA wins for +cpu)
#   TRACEGYM_PIP_EXTRA              more pip options for the image's installs
#   TRACEGYM_EXTRA_CA=FILE          CA bundle the image trusts besides its own (default: pip's `cert`)
#   TRACEGYM_WHEELS=DIR             local wheels for the build (default: pip's `find-links`)
#   DEBIAN_MIRROR, DEBIAN_SUITE     for debootstrap (default: this host's apt mirror, bookworm)
#   TRACEGYM_REBUILD_BASE=1         make the Debian base image again even if it exists
# Layers are cached by Docker: a second run rebuilds only what changed (seconds when nothing did).
set -euo pipefail
cd "$(dirname "$0")/.."

BASE_MODE=${TRACEGYM_BASE:-auto}
IMAGE=${TRACEGYM_IMAGE:-tracegym:latest}
PY_DEBIAN=tracegym/debian-python:bookworm
PG_DEBIAN=tracegym/postgres:debian
SUITE=${DEBIAN_SUITE:-bookworm}
STEP="start" HINT=""

trap 'echo "docker_images.sh: step \"$STEP\" failed. $HINT" >&2' ERR
step() {  # step NAME HINT: announce a step and what to do if it fails
  STEP=$1 HINT=$2 STEP_T0=$SECONDS
  echo "== $STEP"
}
done_step() { echo "   done in $((SECONDS - STEP_T0)) s"; }

pip_setting() {  # the value pip's configuration gives KEY (cert, find-links), or nothing
  python3 -m pip config list 2>/dev/null | sed -n "s/^[^ ]*\.$1='\(.*\)'\$/\1/p" | head -1
}

apt_mirror() {  # the first http(s) Debian mirror this host's apt uses
  cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources 2>/dev/null \
    | grep -oE '^(deb|URIs:) +https?://[^ ]+/debian/?( |$)' | grep -oE 'https?://[^ ]+' | head -1 || true
}

step "docker engine" "Start it (as root: dockerd >/tmp/dockerd.log 2>&1 &) and check \`docker info\`."
docker info >/dev/null
done_step

PG_IMAGE=postgres:16 BASE_IMAGE=python:3.11-slim USED=pulled
if [ "$BASE_MODE" != debian ]; then
  step "pull python:3.11-slim and postgres:16" "No image registry answers here: run with TRACEGYM_BASE=debian (or auto)."
  if docker pull -q python:3.11-slim >/dev/null 2>&1 && docker pull -q postgres:16 >/dev/null 2>&1; then
    done_step
  elif [ "$BASE_MODE" = pull ]; then
    false
  else
    echo "   no image registry answers: building the base images from Debian's packages"
    BASE_MODE=debian
  fi
fi

if [ "$BASE_MODE" = debian ]; then
  USED="built from Debian's packages"
  BASE_IMAGE=$PY_DEBIAN PG_IMAGE=$PG_DEBIAN
  if [ -n "${TRACEGYM_REBUILD_BASE:-}" ] || ! docker image inspect "$PY_DEBIAN" >/dev/null 2>&1; then
    MIRROR=${DEBIAN_MIRROR:-$(apt_mirror)}
    MIRROR=${MIRROR:-http://deb.debian.org/debian}
    step "$PY_DEBIAN: debootstrap $SUITE from $MIRROR" \
      "debootstrap needs root and the Debian mirror (check \`apt-get update\`; set DEBIAN_MIRROR=URL for another); its log is printed above."
    if ! command -v debootstrap >/dev/null; then
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
    fi
    ROOTFS=$(mktemp -d /var/tmp/tracegym-rootfs.XXXXXX)
    trap 'rm -rf "$ROOTFS"' EXIT
    if ! debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates,curl \
        "$SUITE" "$ROOTFS" "$MIRROR" >"$ROOTFS.log" 2>&1; then
      tail -20 "$ROOTFS.log" >&2
      rm -f "$ROOTFS.log"
      false
    fi
    rm -f "$ROOTFS.log"
    rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/*
    done_step
    step "$PY_DEBIAN: docker import" "Check the disk space (df -h /var/lib/docker)."
    tar -C "$ROOTFS" -c . | docker import \
      -c 'ENV LANG=C.UTF-8 PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
      -c 'CMD ["/bin/bash"]' \
      -m "debootstrap --variant=minbase $SUITE from $MIRROR" - "$PY_DEBIAN" >/dev/null
    rm -rf "$ROOTFS"
    docker run --rm "$PY_DEBIAN" python3 -c 'import venv, ssl' >/dev/null
    done_step
  else
    echo "== $PY_DEBIAN: present (TRACEGYM_REBUILD_BASE=1 makes it again)"
  fi
  step "$PG_DEBIAN: Debian's postgresql" "apt-get inside the build must reach the Debian mirror; its output is above."
  PG_LOG=${TMPDIR:-/tmp}/tracegym-postgres-build.log
  docker build -t "$PG_DEBIAN" --build-arg BASE_IMAGE="$PY_DEBIAN" deploy/docker/postgres >"$PG_LOG" 2>&1 \
    || { tail -30 "$PG_LOG" >&2; false; }
  done_step
fi

step "stage deploy/docker/extra (CA bundle, local wheels)" "Check TRACEGYM_EXTRA_CA and TRACEGYM_WHEELS."
EXTRA=deploy/docker/extra
CA=${TRACEGYM_EXTRA_CA-$(pip_setting cert)}
WHEELS=${TRACEGYM_WHEELS-$(pip_setting find-links)}
if [ -n "$CA" ]; then
  cmp -s "$CA" "$EXTRA/ca.crt" || cp "$CA" "$EXTRA/ca.crt"
  echo "   extra CA bundle: $CA"
else
  rm -f "$EXTRA/ca.crt"
fi
mkdir -p "$EXTRA/wheels"
if [ -n "$WHEELS" ] && [ -d "$WHEELS" ]; then
  for w in "$WHEELS"/*.whl; do
    [ -e "$w" ] || continue
    [ -e "$EXTRA/wheels/$(basename "$w")" ] || cp "$w" "$EXTRA/wheels/"
    echo "   local wheel: $(basename "$w")"
  done
fi
done_step

step "$IMAGE from $BASE_IMAGE" "pip inside the build must reach its index (a network that intercepts TLS needs TRACEGYM_EXTRA_CA); the failing instruction is above."
BUILD_LOG=${TMPDIR:-/tmp}/tracegym-image-build.log
BUILD_ARGS=(--build-arg BASE_IMAGE="$BASE_IMAGE"
  --build-arg TORCH_SPEC="${TRACEGYM_TORCH_SPEC:-torch==2.13.0}"
  --build-arg PIP_EXTRA="${TRACEGYM_PIP_EXTRA:-}"
  --build-arg PRELOAD_MODELS="${TRACEGYM_PRELOAD_MODELS-smollm2-135m tiny-random}")
# The virtualenv and models stages are tagged (tracegym-build:models), so that pruning the untagged
# images that earlier builds left behind never drops them from the layer cache.
docker build --target models -t tracegym-build:models "${BUILD_ARGS[@]}" . >"$BUILD_LOG" 2>&1 \
  || { tail -40 "$BUILD_LOG" >&2; false; }
docker build -t "$IMAGE" "${BUILD_ARGS[@]}" . >>"$BUILD_LOG" 2>&1 || { tail -40 "$BUILD_LOG" >&2; false; }
docker image prune -f >/dev/null  # the earlier builds' images that no tag names any more
grep -E '^Step [0-9]+/' "$BUILD_LOG" | grep -vE ' : (ENV|ARG|WORKDIR|VOLUME|ENTRYPOINT|CMD) ' | sed 's/^/   /' | cut -c1-110
echo "   build log: $BUILD_LOG"
docker run --rm --entrypoint python "$IMAGE" -c 'import torch, ray, tracegym.gateway.app, tracegym.engine' 
done_step

echo "== images"
docker image ls --format '   {{.Repository}}:{{.Tag}}  {{.Size}}' | grep -E "^($IMAGE|$BASE_IMAGE|$PG_IMAGE)  " | sed 's/^/   /' || true
echo "base images: $USED"
if [ "$PG_IMAGE" != postgres:16 ]; then
  echo "export TRACEGYM_POSTGRES_IMAGE=$PG_IMAGE   # docker-compose.yml's postgres (default postgres:16)"
fi
