#!/usr/bin/env bash
# What dp_matrix.sh needs on the device machine that its image lacks: pyzmq (loom imports it) for CPython 3.12.
# Run here, in the repo root, once per session, with network; the wheel goes to .whl/ (in .gitignore; the run
# carries it: carry=[".whl"]). The image has torch 2.11, numpy, rich, safetensors and
# matplotlib already (/work/.library/device/KINDS.md). pyzmq's cp312-abi3 wheel bundles libzmq: no other wheel.
set -eu
cd "$(git rev-parse --show-toplevel)"
mkdir -p .whl
"${PYTHON:-python3}" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl pyzmq==27.1.0
ls -la .whl
