"""The sm_90 blockwise FP8 GEMM ``Y = A · Bᵀ`` for 1x128 A scales and 128x128 B scales, in CUDA C++ for NVRTC.

A (M, K) and B (N, K) are E4M3 codes, row-major; A's scales are one float per row and 128-wide K block, stored
(K/128, row stride) as lowbit keeps them; B's are one float per 128 x 128 block, (N/128, ld). Each 128-wide K block's
product is formed on the tensor cores (wgmma, FP32) and promoted into an FP32 accumulator with both scales:
``acc += partial · (sa · sb)``, the sum NUMERICS §5 defines; the result is rounded once to BF16.

The schedule: persistent CTAs of three warpgroups. Warpgroup 0 keeps 40 registers a thread and one thread of it loads
A, B and A's scales into a ring of ``STAGES`` shared-memory stages with TMA; warpgroups 1 and 2 take 232 registers and
each computes half the rows of the CTA's ``BLOCK_M`` x ``BLOCK_N`` tile, 64 rows at a time: four wgmma of K 32 a block,
waited for, then the promotion while the other warpgroup's wgmma run; the K loop is unrolled four deep, and B's scales
for the tile's column block are copied into shared memory before its mainloop. With ``CLUSTER`` 2, two CTAs side by
side along N share A's tile: each loads half of it into both by TMA multicast, and a stage is refilled once the
consumers of both have released it. The tile goes out through shared memory and a TMA store, which the next tile's
mainloop overlaps. Tiles go to CTAs in groups of ``GROUP_M`` row blocks, so that the tiles running at once share their
operands in L2.
"""

from __future__ import annotations

__all__ = ["source", "KERNEL_NAME", "shared_bytes", "THREADS", "BLOCK_K", "MAX_K_BLOCKS"]

KERNEL_NAME = "lowbit_fp8_gemm_1x128_128x128_sm90"
THREADS = 384
BLOCK_K = 128
MAX_K_BLOCKS = 1024
"""The most 128-wide K blocks a call may have (K up to 131072): B's scales for a tile's column block sit in shared
memory."""

_SOURCE = r"""
typedef unsigned int u32;
typedef unsigned long long u64;

struct __align__(64) TmaDesc { u64 v[16]; };

#define A_BYTES (BLOCK_M * BLOCK_K)
#define B_BYTES (BLOCK_N * BLOCK_K)
#define SA_BYTES (BLOCK_M * 4)
#define D_BYTES (BLOCK_M * BLOCK_N * 2)
#define HALVES (BLOCK_M / 128)  // 64-row wgmma blocks a consumer warpgroup runs one after the other

__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mbar_init(u64* bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(smem_addr(bar)), "r"(count));
}

__device__ __forceinline__ void mbar_expect_tx(u64* bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbar_arrive(u64* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(smem_addr(bar)) : "memory");
}

// an arrival on the barrier at the same offset in CTA `rank` of the cluster (this CTA's own included)
__device__ __forceinline__ void mbar_arrive_cluster(u64* bar, u32 rank) {
  u32 remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_addr(bar)), "r"(rank));
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" :: "r"(remote) : "memory");
}

__device__ __forceinline__ void mbar_wait(u64* bar, u32 parity) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra WAIT;\n"
      "}\n" :: "r"(smem_addr(bar)), "r"(parity) : "memory");
}

__device__ __forceinline__ void tma_load(void* dst, const TmaDesc* desc, u64* bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];"
      :: "r"(smem_addr(dst)), "l"((u64)desc), "r"(smem_addr(bar)), "r"(c0), "r"(c1) : "memory");
}

// the box lands at the same offset in both CTAs of the cluster, and completes bytes on each one's barrier
__device__ __forceinline__ void tma_load_multicast(void* dst, const TmaDesc* desc, u64* bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%3, %4}], [%2], %5;"
      :: "r"(smem_addr(dst)), "l"((u64)desc), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "h"((unsigned short)3)
      : "memory");
}

// K-major operand, 128-byte swizzle: rows of 128 bytes, 8-row groups 1024 bytes apart
__device__ __forceinline__ u64 smem_desc(const void* p) {
  u64 d = (u64)((smem_addr(p) & 0x3FFFF) >> 4);
  d |= (u64)1 << 16;
  d |= (u64)(1024 >> 4) << 32;
  d |= (u64)1 << 62;
  return d;
}

@WGMMA@

// one 128-wide K block of this warpgroup's 64 x BLOCK_N tile: four wgmma of K 32, committed as one group
__device__ __forceinline__ void issue(float* d, const unsigned char* a, const unsigned char* b) {
  const u64 da = smem_desc(a), db = smem_desc(b);
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
  for (int k = 0; k < BLOCK_K / 32; ++k) wgmma(d, da + 2 * k, db + 2 * k, k);
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}

// named barrier 1 (0 is __syncthreads'): the two consumer warpgroups
__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, 256;" ::: "memory"); }

// the registers of a finished wgmma: keep the compiler from reading them before the wait
__device__ __forceinline__ void fence_operands(float* d) {
#pragma unroll
  for (int j = 0; j < BLOCK_N / 2; ++j) asm volatile("" : "+f"(d[j]) :: "memory");
}

__device__ __forceinline__ u32 bf16x2(float lo, float hi) {
  u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// CLUSTER CTAs take the CLUSTER column blocks of one "tile" of BLOCK_M x CLUSTER * BLOCK_N, in groups of GROUP_M rows
__device__ __forceinline__ void tile_of(int tile, int tiles_m, int tiles_n, int& m_blk, int& n_blk) {
  const int per_group = GROUP_M * tiles_n;
  const int first_m = (tile / per_group) * GROUP_M;
  const int group_m = min(tiles_m - first_m, GROUP_M);
  const int in_group = tile % per_group;
  m_blk = first_m + in_group % group_m;
  n_blk = in_group / group_m;
}

extern "C" __global__ void __launch_bounds__(384, 1) @NAME@(
    const __grid_constant__ TmaDesc tma_a, const __grid_constant__ TmaDesc tma_b,
    const __grid_constant__ TmaDesc tma_sa, const __grid_constant__ TmaDesc tma_d, const float* __restrict__ sb,
    int M, int N, int K, int sb_ld) {
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  unsigned char* s_d = smem;  // the output tile, BF16
  unsigned char* s_a = s_d + D_BYTES;
  unsigned char* s_b = s_a + STAGES * A_BYTES;
  float* s_sa = (float*)(s_b + STAGES * B_BYTES);
  u64* full = (u64*)(s_sa + STAGES * BLOCK_M);
  u64* empty = full + STAGES;
  float* s_sb = (float*)(empty + STAGES);  // B's scales for the tile's column block, one a K block

  const int num_kb = (K + BLOCK_K - 1) / BLOCK_K;
  const int tiles_m = (M + BLOCK_M - 1) / BLOCK_M;
  const int tiles_n = (N + BLOCK_N - 1) / BLOCK_N;
  const int pairs_n = (tiles_n + CLUSTER - 1) / CLUSTER;
  const int num_tiles = tiles_m * pairs_n;
  const int wg = threadIdx.x / 128;
  u32 rank = 0;  // this CTA's rank in its cluster: its column block of the tile, its half of A's rows
  if (CLUSTER > 1) asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  const int first_tile = blockIdx.x / CLUSTER, tile_step = gridDim.x / CLUSTER;

  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], 8 * CLUSTER);  // one arrival per consumer warp of each CTA of the cluster
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("prefetch.tensormap [%0];" :: "l"((u64)&tma_a) : "memory");
    asm volatile("prefetch.tensormap [%0];" :: "l"((u64)&tma_b) : "memory");
    asm volatile("prefetch.tensormap [%0];" :: "l"((u64)&tma_sa) : "memory");
    asm volatile("prefetch.tensormap [%0];" :: "l"((u64)&tma_d) : "memory");
  }
  if (CLUSTER > 1) {  // the peer's barriers are initialized before it multicasts into this CTA
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
  } else {
    __syncthreads();
  }

  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (threadIdx.x == 0) {
      int stage = 0;
      u32 phase = 0;
      for (int tile = first_tile; tile < num_tiles; tile += tile_step) {
        int m_blk, n_pair;
        tile_of(tile, tiles_m, pairs_n, m_blk, n_pair);
        const int n_blk = n_pair * CLUSTER + rank;  // (past the last column block: B reads as zeros, nothing stored)
        for (int kb = 0; kb < num_kb; ++kb) {
          mbar_wait(&empty[stage], phase ^ 1);
          mbar_expect_tx(&full[stage], A_BYTES + B_BYTES + SA_BYTES);
          if (CLUSTER > 1) {
            const int rows = BLOCK_M / CLUSTER;  // this CTA loads its share of A's rows into both CTAs
            tma_load_multicast(s_a + stage * A_BYTES + rank * rows * BLOCK_K, &tma_a, &full[stage], kb * BLOCK_K,
                               m_blk * BLOCK_M + rank * rows);
          } else {
            tma_load(s_a + stage * A_BYTES, &tma_a, &full[stage], kb * BLOCK_K, m_blk * BLOCK_M);
          }
          tma_load(s_b + stage * B_BYTES, &tma_b, &full[stage], kb * BLOCK_K, n_blk * BLOCK_N);
          tma_load(s_sa + stage * BLOCK_M, &tma_sa, &full[stage], m_blk * BLOCK_M, kb);
          if (++stage == STAGES) { stage = 0; phase ^= 1; }
        }
      }
      // the peer's consumers arrive on this CTA's barriers until their last stage: wait for them before exiting
      if (CLUSTER > 1)
        for (int i = 0; i < STAGES; ++i) {
          mbar_wait(&empty[stage], phase ^ 1);
          if (++stage == STAGES) { stage = 0; phase ^= 1; }
        }
    }
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
    const int t = threadIdx.x - 128 * wg;
    const int warp = t / 32, lane = t % 32;
    const int wg_row = (wg - 1) * (BLOCK_M / 2);  // this warpgroup's first row in the tile
    const int row = wg_row + warp * 16 + lane / 4;  // this thread's rows in each 64-row half: row, row + 8
    float acc[HALVES][BLOCK_N / 2], part[BLOCK_N / 2];
    int stage = 0;
    u32 phase = 0;
    for (int tile = first_tile; tile < num_tiles; tile += tile_step) {
      int m_blk, n_pair;
      tile_of(tile, tiles_m, pairs_n, m_blk, n_pair);
      const int n_blk = n_pair * CLUSTER + rank;
      const float* sb_row = sb + (long long)((min(n_blk, tiles_n - 1) * BLOCK_N) / 128) * sb_ld;
#pragma unroll
      for (int h = 0; h < HALVES; ++h)
#pragma unroll
        for (int j = 0; j < BLOCK_N / 2; ++j) acc[h][j] = 0.f;
      // (the previous tile's mainloops are done with s_sb: its epilogue synchronized the consumers after them)
      for (int i = threadIdx.x - 128; i < num_kb; i += 256) s_sb[i] = sb_row[i];
      consumers_sync();
#pragma unroll 4
      for (int kb = 0; kb < num_kb; ++kb) {
        const float sb_k = s_sb[kb];
        mbar_wait(&full[stage], phase);
        // A's scales are read before the wgmma are issued: the stage is released right after they finish
        float sa_k[HALVES][2];
#pragma unroll
        for (int h = 0; h < HALVES; ++h) {
          sa_k[h][0] = s_sa[stage * BLOCK_M + row + 64 * h] * sb_k;
          sa_k[h][1] = s_sa[stage * BLOCK_M + row + 64 * h + 8] * sb_k;
        }
#pragma unroll
        for (int h = 0; h < HALVES; ++h) {
          // this warpgroup's rows [wg_row + 64 h, wg_row + 64 h + 64): wgmma, wait, promote
          issue(part, s_a + stage * A_BYTES + (wg_row + 64 * h) * BLOCK_K, s_b + stage * B_BYTES);
          asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
          fence_operands(part);
          const float s0 = sa_k[h][0], s1 = sa_k[h][1];
          if (h == HALVES - 1) {
            __syncwarp();
            if (CLUSTER > 1) {
              if (lane < CLUSTER) mbar_arrive_cluster(&empty[stage], lane);
            } else if (lane == 0) {
              mbar_arrive(&empty[stage]);
            }
          }
#pragma unroll
          for (int j = 0; j < BLOCK_N / 2; ++j) acc[h][j] = __fmaf_rn(part[j], (j & 2) ? s1 : s0, acc[h][j]);
        }
        if (++stage == STAGES) { stage = 0; phase ^= 1; }
      }
      // Epilogue: BF16 into shared memory as TMA boxes of BLOCK_M rows x 64 columns (128-byte rows, 128-byte
      // swizzle), stored by TMA, which clips the rows and columns past M and N. The previous tile's store has read
      // the buffer first.
      if (threadIdx.x == 128) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
      consumers_sync();
      {
        // stmatrix x4: four 8 x 8 blocks a call (rows 0-7 and 8-15 of this warp's 16, two 8-column groups), lane l
        // addressing row l % 8 of block l / 8; a block row is one 16-byte chunk, at chunk ^ (row % 8) = chunk ^ l % 8
        const int m = lane / 8, r = lane % 8;
        const u32 row_at = smem_addr(s_d) + (wg_row + warp * 16 + 8 * (m % 2) + r) * 128;
#pragma unroll
        for (int h = 0; h < HALVES; ++h)
#pragma unroll
          for (int g = 0; g < BLOCK_N / 8; g += 2) {
            const int col_group = g + m / 2;  // this lane's 8-column group
            const u32 at = row_at + ((col_group / 8) * BLOCK_M + 64 * h) * 128 + (((col_group % 8) ^ r) * 16);
            const float* v = &acc[h][4 * g];
            asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};"
                         :: "r"(at), "r"(bf16x2(v[0], v[1])), "r"(bf16x2(v[2], v[3])), "r"(bf16x2(v[4], v[5])),
                            "r"(bf16x2(v[6], v[7])) : "memory");
          }
      }
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // (generic writes, read by TMA)
      consumers_sync();
      if (threadIdx.x == 128) {
#pragma unroll
        for (int b = 0; b < BLOCK_N / 64; ++b)
          asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];"
                       :: "l"((u64)&tma_d), "r"(smem_addr(s_d + b * BLOCK_M * 128)), "r"(n_blk * BLOCK_N + b * 64),
                          "r"(m_blk * BLOCK_M) : "memory");
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
      }
    }
    if (threadIdx.x == 128) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  }
}
"""


def _wgmma(block_n: int) -> str:
    """``wgmma(d, desc_a, desc_b, accumulate)``: one m64 n``block_n`` k32 E4M3 x E4M3 -> FP32 wgmma."""
    n = block_n // 2
    regs = ", ".join(f"%{i}" for i in range(n))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(n))
    return (
        "__device__ __forceinline__ void wgmma(float* d, u64 da, u64 db, int accumulate) {\n"
        "  asm volatile(\n"
        '      "{\\n.reg .pred p;\\n"\n'
        f'      "setp.ne.b32 p, %{n + 2}, 0;\\n"\n'
        f'      "wgmma.mma_async.sync.aligned.m64n{block_n}k32.f32.e4m3.e4m3 {{{regs}}}, %{n}, %{n + 1}, p, 1, 1;\\n"\n'
        '      "}\\n"\n'
        f'      : {outs}\n'
        '      : "l"(da), "l"(db), "r"(accumulate));\n'
        "}\n")


def source(block_m: int, block_n: int, stages: int, group_m: int, cluster: int = 1) -> str:
    """The kernel's CUDA source for a ``block_m`` x ``block_n`` tile, ``stages`` shared-memory stages, row-block groups
    of ``group_m`` and clusters of ``cluster`` CTAs."""
    if block_n % 16 or not 16 <= block_n <= 128:
        raise ValueError(f"block_n: expected a multiple of 16 in [16, 128] (a wgmma N inside one 128-wide scale "
                         f"block of B), got {block_n}")
    if block_m not in (128, 256):
        raise ValueError(f"block_m: expected 128 or 256 (one or two 64-row wgmma blocks a consumer warpgroup), got "
                         f"{block_m}")
    if stages < 2 or group_m < 1:
        raise ValueError(f"stages, group_m: expected at least 2 and 1, got {stages} and {group_m}")
    if cluster not in (1, 2):
        raise ValueError(f"cluster: expected 1 or 2 (CTAs sharing A's tile by TMA multicast), got {cluster}")
    defines = dict(CLUSTER=cluster, BLOCK_M=block_m, BLOCK_K=BLOCK_K, BLOCK_N=block_n, STAGES=stages, GROUP_M=group_m)
    head = "".join(f"#define {k} {v}\n" for k, v in defines.items())
    return head + _SOURCE.replace("@WGMMA@", _wgmma(block_n)).replace("@NAME@", KERNEL_NAME)


def shared_bytes(block_m: int, block_n: int, stages: int) -> int:
    """Dynamic shared memory of a launch: the output tile, the stages, the barriers, B's scales and 1024 bytes for the
    alignment."""
    return (block_m * block_n * 2 + stages * (block_m * BLOCK_K + block_n * BLOCK_K + block_m * 4) + stages * 16
            + MAX_K_BLOCKS * 4 + 1024)
