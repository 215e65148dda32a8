#!/usr/bin/env bash
# Pack another Triton release for the GPU box, whose image carries one version only (the supported
# range is 3.6-3.7). A Triton wheel (~200 MB) is over the device call's 64 MiB, so its shared
# objects are stripped, the profiler (proton, CUPTI) and Blackwell ptxas dropped, and the rest
# xz-packed into .gpu_triton/; gpu.sh unpacks it once per machine and puts it first on the path.
# The CUDA tools (ptxas, nvdisasm, cuobjdump; ~13 MB packed) are left out too, with their sha256:
# gpu.sh copies the image's Triton's own and refuses a pack whose tools differ from them (3.6.0
# and 3.7.1 ship the same CUDA 12.8 builds), which leaves room in a call for the wheels and data
# of the model and service tests. --keep-tools packs them instead (~50 MB).
#   benchmarks/pack_triton.sh 3.7.1 [cp312] [--keep-tools]
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:?triton version}; py=${2:-cp312}; keep_tools=${3:-}
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
source benchmarks/gpu_pip.sh
gpu_pip_download "$work" "$py" "triton==$version"
(cd "$work" && unzip -q triton-*.whl && rm triton-*.whl)
rm -rf "$work"/triton/backends/nvidia/lib/cupti "$work"/triton/_C/libproton.so \
  "$work"/triton/backends/nvidia/bin/ptxas-blackwell "$work"/triton/instrumentation/*.so
find "$work"/triton -name '*.so*' -type f -exec strip --strip-unneeded {} +
if [ "$keep_tools" != --keep-tools ]; then
  (cd "$work"/triton/backends/nvidia/bin && sha256sum ptxas nvdisasm cuobjdump >IMAGE_TOOLS.sha256 &&
    rm ptxas nvdisasm cuobjdump)
fi
mkdir -p .gpu_triton && rm -f .gpu_triton/triton-*.tar.xz
tar cf - -C "$work" . | xz -T0 -6 >".gpu_triton/triton-$version.tar.xz"
ls -l .gpu_triton
