#!/usr/bin/env bash
# Build a GPU model repository with a torch that matches the serving image's libtorch.
#
# Runs inside `python:3.11-slim` (started by the command `nnunet-triton deploy --target docker` prints):
#   /src    this source tree (read-only)        /models the results folder's parent (read-only: a cascade
#                                                       stage needs its sibling previous-stage folder)
#   /out    parent of the output repository     REPOSITORY_OUT  the repository path under /out
#   TORCH_VERSION / TORCHVISION_VERSION          2.14.1 / 0.29.1 for Triton 26.09 (libtorch 2.14)
#   HOST_UID / HOST_GID                          owner of the result on the host
# Arguments are passed to `python -m repository.build` (e.g. --model /models/<folder> --target gpu).
set -euo pipefail

: "${REPOSITORY_OUT:?REPOSITORY_OUT must name the output repository under /out}"
: "${TORCH_VERSION:?}" "${TORCHVISION_VERSION:?}"

mkdir -p /opt/src
# copy the sources without the host's virtualenv, build outputs and git data
tar -C /src --exclude=./.venv --exclude=./build --exclude=./.git -cf - . | tar -C /opt/src -xf -

# the project's lock, minus the torch stack pinned for the host's newer torch (its CUDA wheels, triton, and
# sympy: an older torch may pin another sympy than the lock's -> ResolutionImpossible)
grep -v -E '^(torch|torchvision|triton|sympy|nvidia-[a-z0-9-]+)==' /opt/src/requirements/constraints.txt \
    > /opt/constraints.txt
python -m pip install --no-cache-dir --disable-pip-version-check -c /opt/constraints.txt \
    "torch==${TORCH_VERSION}" "torchvision==${TORCHVISION_VERSION}" nnunetv2 timm

cd /opt/src
export PYTHONPATH=/opt/src/src PYTHONDONTWRITEBYTECODE=1
python -c "import torch; print('export torch', torch.__version__, 'cuda', torch.cuda.is_available())"
python -m repository.build "$@" --model-repository "${REPOSITORY_OUT}"

if [[ -n "${HOST_UID:-}" ]]; then
    chown -R "${HOST_UID}:${HOST_GID:-${HOST_UID}}" "${REPOSITORY_OUT}"
fi
