#!/usr/bin/env bash
# Build DeepGEMM in place (the strongest public blockwise GEMM). On PYTHONPATH it gives `lowbit bench gemm --layers` its
# rows, and lowbit's "deepgemm" GEMM backend runs fp8-block's forward and data-gradient GEMMs (`lowbit info` says so):
#   git clone --recursive https://github.com/deepseek-ai/DeepGEMM     (on a machine with network)
#   bash tools/deepgemm_build.sh DeepGEMM                               (on the GPU machine; about 80 s)
#   PYTHONPATH=DeepGEMM:src python3 -m lowbit bench gemm --layers 1.3b
# It compiles DeepGEMM's one host extension with the system g++ ($DEEPGEMM_CXX, default /usr/bin/g++), whatever
# CC / CXX say: built by the g++ those named on the GPU machine, the extension crashed in std::regex at its first
# kernel. Its kernels are compiled at run time by nvcc from CUDA_HOME. Needs torch with CUDA, setuptools and wheel.
set -euo pipefail
src=${1:?usage: bash tools/deepgemm_build.sh DEEPGEMM_CHECKOUT}
if [ ! -d "$src/third-party/cutlass/include/cute" ] || [ ! -d "$src/third-party/fmt/include" ]; then
  echo "deepgemm_build: $src has no third-party/cutlass or third-party/fmt headers: clone it with --recursive" >&2
  exit 2
fi
cd "$src"
rm -rf deep_gemm/include/cutlass deep_gemm/include/cute  # (links its develop.sh may have made)
cp -r third-party/cutlass/include/cutlass third-party/cutlass/include/cute deep_gemm/include/
cxx=${DEEPGEMM_CXX:-/usr/bin/g++}
CC=$cxx CXX=$cxx LDSHARED="$cxx -shared" DG_USE_LOCAL_VERSION=0 python3 setup.py build_ext --inplace
# one small GEMM, the first kernel compile included (a bad build imports but crashes here)
PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} python3 - <<'PY'
import torch, deep_gemm
a = torch.randn(128, 256, device="cuda").to(torch.float8_e4m3fn)
d = torch.empty(128, 128, device="cuda", dtype=torch.bfloat16)
sa = deep_gemm.get_mn_major_tma_aligned_tensor(torch.ones(128, 2, device="cuda"))
sb = torch.ones(1, 2, device="cuda")
deep_gemm.fp8_fp4_gemm_nt((a, sa), (a, sb), d, recipe=(1, 128, 128), disable_ue8m0_cast=True)
ref = a.float() @ a.float().t()
assert torch.allclose(d.float(), ref, rtol=1e-2, atol=1e-2), "deep_gemm built, but its GEMM is wrong"
print("deep_gemm", deep_gemm.__version__, "built and runs")
PY
