# rlstream for GPUs: one image for every component (feeder, vLLM producers, scorers, the
# reward server, the DeepSpeed learner under torchrun). The command picks the component:
#   docker build -t rlstream:0.1.0-cuda .
#   docker run --gpus all rlstream:0.1.0-cuda producer /etc/rlstream/config.yaml --id p0
# The base is pinned by digest (the multi-arch index of the tag); refresh it with
# `docker buildx imagetools inspect nvidia/cuda:12.8.1-devel-ubuntu24.04`.
FROM nvidia/cuda:12.8.1-devel-ubuntu24.04@sha256:520292dbb4f755fd360766059e62956e9379485d9e073bbd2f6e3c20c270ed66

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/rlstream \
    PATH=/opt/rlstream/bin:$PATH \
    HF_HUB_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false

# A compiler and the CUDA toolkit (this devel base) let DeepSpeed build its fused ops.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential ninja-build libnuma1 \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv $VIRTUAL_ENV

WORKDIR /src
# Every package the image runs, torch and vLLM's CUDA builds included, from deploy/locks/cuda.txt:
# pinned, each file checked against its sha256 (--require-hashes), nothing resolved at build
# time (--no-deps).
# DeepSpeed comes as an sdist: it builds with the checked setuptools and wheel, installed first.
COPY deploy/locks/cuda-build.txt /etc/rlstream-build-lock.txt
COPY deploy/locks/cuda.txt /etc/rlstream-lock.txt
RUN pip install --require-hashes --no-deps -r /etc/rlstream-build-lock.txt \
 && pip install --require-hashes --no-deps --no-build-isolation -r /etc/rlstream-lock.txt

COPY pyproject.toml README.md ./
COPY rlstream ./rlstream
# rlstream itself, from this source tree: its build backend (setuptools) is in the lock.
RUN pip install --no-deps --no-build-isolation . \
 && rlstream --version

# Not root: the manifests run it as this uid with a read-only root filesystem (caches go
# to $HOME, which they mount as an emptyDir at /tmp).
RUN useradd --uid 10001 --user-group --no-create-home --home-dir /tmp rlstream \
 && mkdir -p /work && chown 10001:10001 /work
USER 10001:10001
WORKDIR /work
ENTRYPOINT ["rlstream"]
CMD ["validate", "/etc/rlstream/config.yaml"]
