# Sourced by gpu_wheels.sh and pack_triton.sh: `gpu_pip_download DIR PY SPEC...` fetches the
# binary wheels of SPEC for the GPU box (x86-64 Linux, CPython PY, e.g. cp312) into DIR, without
# their dependencies.
gpu_pip_download() {
  local dir=$1 py=$2
  shift 2
  python3 -m pip download -q --no-deps --only-binary=:all: --implementation cp \
    --python-version "${py#cp}" --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d "$dir" "$@" 2>&1 | { grep -v '^WARNING' || true; }
}
