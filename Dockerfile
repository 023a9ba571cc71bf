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
# torch first and pinned: the release vLLM, DeepSpeed and rlstream agree on (a CUDA build on Linux).
RUN pip install torch==2.13.0

COPY deploy/constraints.txt /etc/rlstream-constraints.txt
COPY pyproject.toml README.md ./
COPY rlstream ./rlstream
# The package with vLLM and DeepSpeed. The [vllm] extra names vLLM's CPU build (what the
# CPU image and CI use); on GPUs the CUDA build of the same vLLM release takes its place.
# Every transitive dependency is held to deploy/constraints.txt.
RUN pip install -c /etc/rlstream-constraints.txt ".[deepspeed]" "vllm==0.32.0" \
 && rlstream --version

# Not root: the manifests run it as this uid with a read-only root filesystem (caches go
# to $HOME, which they mount as an emptyDir at /tmp).
RUN useradd --uid 10001 --user-group --no-create-home --home-dir /tmp rlstream \
 && mkdir -p /work && chown 10001:10001 /work
USER 10001:10001
WORKDIR /work
ENTRYPOINT ["rlstream"]
CMD ["validate", "/etc/rlstream/config.yaml"]
