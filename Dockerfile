# gpu-dra driver image: both processes, one image.
#   controller:     gpu-dra-controller      (runs as the non-root user below)
#   kubelet plugin: gpu-dra-kubelet-plugin  (the chart runs it as root, privileged: the kubelet's
#                   plugin directories, CDI spec dirs, NVML, MPS shm mounts)
# Python is Debian's (bookworm: 3.11). The base is Debian's slim image from a registry, or the
# same Debian made locally: python -m e2e.cluster.driverimage builds this file without a Docker
# engine (mmdebstrap + buildah; docs/deployment.md, "Image").
#   docker build -t gpu-dra:dev .
ARG BASE_IMAGE=debian:bookworm-slim

FROM ${BASE_IMAGE} AS build
# Versions come with the base's Debian release (bookworm); a point release may replace them.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
# pip checks TLS against this bundle: the system's, or one the build mounts (--build-arg).
ARG PIP_CERT=/etc/ssl/certs/ca-certificates.crt
ENV PIP_CERT=${PIP_CERT} \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY driver driver
COPY kube kube
COPY cli cli
COPY controller controller
COPY kubelet-plugin kubelet-plugin
# The gpu-dra wheel and wheels of its pinned dependencies, installed into a venv without pip.
RUN python3 -m venv /opt/build \
    && /opt/build/bin/pip install --no-cache-dir build==1.3.0 \
    && /opt/build/bin/python -m build --wheel --outdir /wheels . \
    && /opt/build/bin/pip wheel --no-cache-dir --wheel-dir /wheels /wheels/gpu_dra-*.whl \
    && python3 -m venv --without-pip /opt/gpu-dra \
    && /opt/build/bin/pip --python /opt/gpu-dra/bin/python install --no-cache-dir \
        --no-index --find-links /wheels gpu-dra==0.1.0

FROM ${BASE_IMAGE}
LABEL org.opencontainers.image.title="gpu-dra" \
      org.opencontainers.image.description="Kubernetes DRA driver for NVIDIA GPUs"
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 65532 --no-create-home --shell /usr/sbin/nologin gpu-dra
COPY --from=build /opt/gpu-dra /opt/gpu-dra
COPY deviceclasses /etc/gpu-dra/deviceclasses
ENV PATH=/opt/gpu-dra/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
USER 65532
ENTRYPOINT ["gpu-dra-controller"]
