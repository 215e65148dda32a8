#!/usr/bin/env bash
# Pack another Triton release for the GPU box, whose image carries one version only (the supported
# range is 3.6-3.7). A Triton wheel (~200 MB) is over the device call's 64 MiB, so its shared
# objects are stripped, the profiler (proton, CUPTI) and Blackwell ptxas dropped, and the rest
# xz-packed into .gpu_triton/ (~50 MB); gpu.sh unpacks it once per machine and puts it first on
# the path.   benchmarks/pack_triton.sh 3.7.1 [cp312]
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:?triton version}; py=${2:-cp312}
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --implementation cp \
  --python-version "${py#cp}" --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$work" "triton==$version"
(cd "$work" && unzip -q triton-*.whl && rm triton-*.whl)
rm -rf "$work"/triton/backends/nvidia/lib/cupti "$work"/triton/_C/libproton.so \
  "$work"/triton/backends/nvidia/bin/ptxas-blackwell "$work"/triton/instrumentation/*.so
find "$work"/triton -name '*.so*' -type f -exec strip --strip-unneeded {} +
mkdir -p .gpu_triton && rm -f .gpu_triton/triton-*.tar.xz
tar cJf ".gpu_triton/triton-$version.tar.xz" -C "$work" .
ls -l .gpu_triton
