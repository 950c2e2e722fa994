#!/usr/bin/env bash
# Build DeepGEMM in place so that `lowbit bench gemm --layers` gets its rows (the strongest public blockwise GEMM):
#   git clone --recursive https://github.com/deepseek-ai/DeepGEMM     (on a machine with network)
#   bash tools/deepgemm_build.sh DeepGEMM                               (on the GPU machine; about 80 s)
#   PYTHONPATH=DeepGEMM:src python3 -m lowbit bench gemm --layers 1.3b
# It compiles DeepGEMM's one host extension with the system g++ ($CXX, default /usr/bin/g++): built with the compiler
# wrapper Python names (sysconfig's CC), the extension crashed in std::regex at its first kernel. Its kernels are
# compiled at run time by nvcc from CUDA_HOME. Needs torch with CUDA, setuptools and wheel.
set -euo pipefail
src=${1:?usage: bash tools/deepgemm_build.sh DEEPGEMM_CHECKOUT}
if [ ! -d "$src/third-party/cutlass/include/cute" ] || [ ! -d "$src/third-party/fmt/include" ]; then
  echo "deepgemm_build: $src has no third-party/cutlass or third-party/fmt headers: clone it with --recursive" >&2
  exit 2
fi
cd "$src"
cp -r third-party/cutlass/include/cutlass third-party/cutlass/include/cute deep_gemm/include/
cxx=${CXX:-/usr/bin/g++}
CC=${CC:-/usr/bin/gcc} CXX=$cxx LDSHARED="$cxx -shared" DG_USE_LOCAL_VERSION=0 python3 setup.py build_ext --inplace
PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} python3 -c "import deep_gemm; print('deep_gemm', deep_gemm.__version__, 'built')"
