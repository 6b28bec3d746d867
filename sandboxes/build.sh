#!/usr/bin/env bash
# Build the sandbox images into the local Docker engine without a registry.
#
#   sandboxes/build.sh            # agentrl/host-python, agentrl/python-sandbox, agentrl/swe-base
#   BASE=python:3.11-slim sandboxes/build.sh   # where a registry is reachable: skip the host import
#
# 1. (no BASE given) make a root filesystem from this host's shell, tools and python3 and
#    `docker import` it as agentrl/host-python:latest;
# 2. build Dockerfile.python FROM that base -> agentrl/python-sandbox:latest;
# 3. vendor pytest (pure Python, from the Python running this script) and build
#    Dockerfile.swe -> agentrl/swe-base:latest.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
TAG=${TAG:-latest}
if [ -z "${BASE:-}" ]; then
    tarball=$(mktemp --suffix=.tar)
    trap 'rm -f "$tarball"' EXIT
    "$PY" host_rootfs.py "$tarball" --python
    docker import "$tarball" "agentrl/host-python:$TAG"
    BASE="agentrl/host-python:$TAG"
fi
docker build -f Dockerfile.python --build-arg "BASE=$BASE" -t "agentrl/python-sandbox:$TAG" .
"$PY" vendor.py collect vendor pytest
docker build -f Dockerfile.swe --build-arg "BASE=agentrl/python-sandbox:$TAG" -t "agentrl/swe-base:$TAG" .
echo "built agentrl/python-sandbox:$TAG and agentrl/swe-base:$TAG"
