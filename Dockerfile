# gpu-dra driver image: both processes, one image.
#   controller:     gpu-dra-controller      (runs as the non-root user below)
#   kubelet plugin: gpu-dra-kubelet-plugin  (the chart runs it as root, privileged: the kubelet's
#                   plugin directories, CDI spec dirs, NVML, MPS shm mounts)
# Python is Debian's (bookworm: 3.11). The base is Debian's slim image from a registry, or the
# same Debian made locally: python -m e2e.cluster.driverimage builds this file without a Docker
# engine (mmdebstrap + buildah; docs/deployment.md, "Image").
#   docker build -t gpu-dra:dev .
ARG BASE_IMAGE=debian:bookworm-slim

# Three stages, ordered so that a build with a layer cache (buildah bud --layers, docker build)
# redoes only what changed: `deps` depends on pyproject.toml alone, `build` on the sources.
FROM ${BASE_IMAGE} AS deps
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
COPY pyproject.toml ./
# The pinned runtime dependencies ([project].dependencies) as wheels, installed into a venv
# without pip; the build tools ([build-system].requires and `build`) into /opt/build.
RUN python3 -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb")); \
print("\n".join(p["project"]["dependencies"]), file=open("requirements.txt", "w")); \
print("\n".join(p["build-system"]["requires"]), file=open("build-requirements.txt", "w"))' \
    && python3 -m venv /opt/build \
    && /opt/build/bin/pip install --no-cache-dir build==1.3.0 \
        -r build-requirements.txt \
    && /opt/build/bin/pip wheel --no-cache-dir --wheel-dir /wheels \
        -r requirements.txt \
    && python3 -m venv --without-pip /opt/gpu-dra \
    && /opt/build/bin/pip --python /opt/gpu-dra/bin/python install --no-cache-dir \
        --no-index --find-links /wheels -r requirements.txt

FROM deps AS build
COPY README.md ./
COPY driver driver
COPY kube kube
COPY cli cli
COPY controller controller
COPY kubelet-plugin kubelet-plugin
# The gpu-dra wheel alone, offline: under /staging, the files the runtime stage adds to the
# dependencies' venv (bytecode compiled for its place there), and into that venv here to check it
# against them (pip check).
RUN /opt/build/bin/python -m build --wheel --no-isolation --outdir /dist . \
    && /opt/build/bin/pip --python /opt/gpu-dra/bin/python install --no-cache-dir \
        --no-index --find-links /dist --no-deps --root /staging gpu-dra \
    && /opt/gpu-dra/bin/python -m compileall -q -f -s /staging -p / /staging/opt/gpu-dra \
    && /opt/build/bin/pip --python /opt/gpu-dra/bin/python install --no-cache-dir \
        --no-index --find-links /dist --no-deps gpu-dra \
    && /opt/build/bin/pip --python /opt/gpu-dra/bin/python check

FROM ${BASE_IMAGE}
LABEL org.opencontainers.image.title="gpu-dra" \
      org.opencontainers.image.description="Kubernetes DRA driver for NVIDIA GPUs"
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 65532 --no-create-home --shell /usr/sbin/nologin gpu-dra
COPY --from=deps /opt/gpu-dra /opt/gpu-dra
COPY deviceclasses /etc/gpu-dra/deviceclasses
COPY --from=build /staging/ /
ENV PATH=/opt/gpu-dra/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
USER 65532
ENTRYPOINT ["gpu-dra-controller"]
