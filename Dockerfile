# The image every KubeRay manifest in k8s/ names (k8s/render.py IMAGE). Build it from the repository root:
#   docker build -t ghcr.io/offload-serve/offload-serve:0.1.0-ray2.60.0-py311-gpu .
# Ray's own GPU image (CUDA, Ray 2.60.0, Python 3.11); the project is installed the way the
# Makefile installs it (torch first, then the project pinned by constraints.txt), without the test
# extras, as Ray's non-root user. tests/k8s/test_image.py keeps these steps and the Makefile's in step.
FROM rayproject/ray:2.60.0-py311-gpu

# The CUDA build of torch (the image has a GPU driver's libraries; the Makefile picks it on nvidia-smi).
ARG TORCH_SPEC=torch
ENV HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0

USER root
WORKDIR /opt/offload-serve
COPY pyproject.toml constraints.txt README.md ./
COPY compat ./compat
COPY offload_core ./offload_core
COPY cluster ./cluster
COPY deployments ./deployments
COPY zoo ./zoo
COPY configs ./configs
RUN chown -R 1000:100 /opt/offload-serve

# Ray's image runs as `ray` (uid 1000, group users); so does every Ray process in the pods.
USER 1000
RUN python -m pip install -q --upgrade pip && \
    python -m pip install -q "${TORCH_SPEC}" && \
    python -m pip install -q -c constraints.txt .
