// flash_bwd_sm90.cu -- dKj, dVj (and dQi through float32 atomics) of the
// FlashAttention backward for Hopper (sm_90a), float16 / bfloat16 on the
// warpgroup tensor-core instructions (wgmma.mma_async, float32 accumulators).
//
// Algorithm: FlashAttention-2 backward (Dao 2023, Algorithm 2), the products
// arranged as in FlashAttention-3's backward (Shah et al. 2024, section 3.3
// and appendix B): each warpgroup computes the transposed tiles
//   Sij^T  = Kj Qi^T,   dPij^T = Vj dOi^T        (keys as the M dimension)
//   Pij^T  = exp2(Sij^T * scale * log2(e) + bias - Li)    (0 where masked)
//   dSij^T = Pij^T o (dPij^T - Di)
// so that Pij^T and dSij^T sit in registers in the layout of an A operand:
//   dVj += Pij^T dOi,   dKj += dSij^T Qi          (A from registers)
// and dQi += dSij Kj reads dSij^T back from shared memory as an MN-major A
// operand.  Pij, dSij are rounded to the input type before a product; every
// sum runs in float32; dKj is scaled by `scale` at the end, dQi on its way
// into the float32 accumulator.  With dQacc = nullptr (deterministic mode)
// the dQ product is skipped and flash_bwd_dq_kernel computes dQ.
//
// dQi into the accumulator, with DQ_BULK (Tiles.bwd90_dq_bulk; up to head
// dim 128, where D is the bucket's head dim): each thread stages its part of scale * dSij Kj in one of two
// float32 tiles dQs [Br][D], laid out as the accumulator's rows of the query
// tile are; after the next block barrier thread 0 hands the whole tile to the
// copy engine (one cp.reduce.async.bulk .add.f32), which adds it at the L2
// while the next query tile's products run.  Before the barrier that lets a
// tile's dQi overwrite a buffer, thread 0 waits until the engine has read
// what that buffer held two tiles before.  Otherwise (without DQ_BULK; head
// dims 192 and 256, whose shared memory is full; D below the bucket's) each
// thread adds its dQi elements with float32 atomics (dq_add_pair).
//
// The module's other kernels (flash_bwd_preprocess, flash_bwd_dq_kernel,
// flash_bwd_convert_dq, flash_bwd_sum_groups) and dq_add_pair come from
// flash_bwd_rows_f16.cuh, the swizzled shared-memory tiles and the wgmma
// helpers from flash_common_sm90.cuh.
//
// Assumptions: as flash_bwd_f16.cu.
//
// Two tile layouts, both with 2 warpgroups of 128 threads (B90_WGS):
// * HEAD_DIM <= 128: Bc = 128 keys, warpgroup w owns keys 64w..64w+63 and
//   computes Sij^T, dPij^T for them; Pij^T and dSij^T stay in registers as
//   the A operands of dVj, dKj (as described above).  Per thread: Sij^T and
//   dPij^T as Br/2 floats each, dKj and dVj as HEAD_DIM/2 floats each, its
//   share of dQi as DQ_N0/2 or DQ_N1/2 floats (warpgroup 0 computes dQi
//   columns [0, DQ_N0), warpgroup 1 [DQ_N0, HEAD_DIM); a third warpgroup,
//   where the registers allow one (B90_WGS 3: Bc = 192), only dKj, dVj).  Shared memory
//   (swizzled, 1024-byte aligned): Kj, Vj [HD_ATOMS][Bc][64]; Qi, dOi
//   [2 stages][HD_ATOMS][Br][64]; dSij^T [Br/64][Bc][64]; Li, Di [2][Br].
// * HEAD_DIM 192, 256: dKj, dVj of 64 keys would not fit one warpgroup's
//   registers; Bc = 64 keys and the head dim is split between the
//   warpgroups instead (layout further below).
// One kernel serves both: its frame (loads, the query loop, the output) is
// common, the products and the softmax step differ by layout (#if HEAD_DIM
// <= 128).  The next query tile loads (cp.async) while this one is used.

#include "flash_bwd_rows_f16.cuh"
#include "flash_common_sm90.cuh"

#ifndef B90_WGS
#error "B90_WGS must be defined (pycudaflash.compiler.defines)"
#endif
#define B90_THREADS (B90_WGS * WG_THREADS)
#ifndef B90_BR
#error "B90_BR must be defined (pycudaflash.compiler.defines)"
#endif
#ifndef DQ_BULK
#error "DQ_BULK must be defined (pycudaflash.compiler.defines)"
#endif
// The dQi staging tiles, DQ_STAGES of [Br][DQS_LD] floats, with DQ_BULK up to
// head dim 128 (above it the shared memory is full).
#define DQ_STAGES 2
#if DQ_BULK && HEAD_DIM <= 128
#define DQS_LD HEAD_DIM
#define DQS_FLOATS (DQ_STAGES * B90_BR * DQS_LD)
#else
#define DQS_LD HEAD_DIM  // (no staging tiles)
#define DQS_FLOATS 0
#endif

// scale * dQi into the float32 accumulator: rows i_w and i_w + 8 of this
// thread (those below Nq) of a wgmma tile of NC columns from c0, whose
// NC/2 accumulators a thread are dq.
template <int NC>
__device__ __forceinline__ void dq_add_rows(float *dQacc, i64 row_base, int i_w, int Nq, int D, float scale, int c0,
                                            const float (&dq)[NC / 2], int t) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int i = i_w + 8 * r;
        if (i < Nq) {
            float *row = dQacc + (row_base + i) * D;
#pragma unroll
            for (int n = 0; n < NC / 8; ++n)
                dq_add_pair(row, c0 + 8 * n + 2 * t, D, scale * dq[4 * n + 2 * r], scale * dq[4 * n + 2 * r + 1]);
        }
    }
}

// scale * dQi into the staging tile dQs (rows DQS_LD floats apart): rows i_w
// and i_w + 8 of the tile (all of them; rows past Nq are never reduced), as
// dq_add_rows.
template <int NC>
__device__ __forceinline__ void dq_stage_rows(float *dQs, int i_w, float scale, int c0, const float (&dq)[NC / 2],
                                              int t) {
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int n = 0; n < NC / 8; ++n)
            *reinterpret_cast<float2 *>(dQs + (i_w + 8 * r) * DQS_LD + c0 + 8 * n + 2 * t) =
                make_float2(scale * dq[4 * n + 2 * r], scale * dq[4 * n + 2 * r + 1]);
}

// Write dKj (scaled) and dVj: rows j_w and j_w + 8 of this thread (those
// below Nk) of a wgmma tile of NC columns from c0, columns from c_from on.
template <int NC>
__device__ __forceinline__ void store_kv(elem_t *dKg, elem_t *dVg, i64 dk_sn, i64 dv_sn, const float (&dk)[NC / 2],
                                         const float (&dv)[NC / 2], float scale, int j_w, int Nk, int D, int c0,
                                         int c_from, int t, bool vec) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int j = j_w + 8 * r;
        if (j < Nk) {
#pragma unroll
            for (int n = 0; n < NC / 8; ++n) {
                const int d = c0 + 8 * n + 2 * t;
                if (d < c_from) continue;
                store_pair(dKg + (i64)j * dk_sn, d, D, scale * dk[4 * n + 2 * r], scale * dk[4 * n + 2 * r + 1], vec);
                store_pair(dVg + (i64)j * dv_sn, d, D, dv[4 * n + 2 * r], dv[4 * n + 2 * r + 1], vec);
            }
        }
    }
}

#if HEAD_DIM <= 128
// ================================================ head dim <= 128: dKj, dVj in registers
#define B90_BC (64 * B90_WGS)
#define ST_REGS (B90_BR / 2)       // Sij^T, dPij^T floats per thread
#define KV_REGS (HEAD_DIM / 2)     // dKj, dVj floats per thread
// dQi columns per warpgroup: whole 64-column blocks where possible, else a
// half block (wgmma may start an MN-major operand inside a block only where
// its N columns stay in that block).
#if HEAD_DIM == 64
#define DQ_N0 32
#elif HEAD_DIM == 96
#define DQ_N0 64
#else
#define DQ_N0 (HEAD_DIM / 2)
#endif
#define DQ_N1 (HEAD_DIM - DQ_N0)
// dQi's A operand, dSij^T: MN-major, k steps 16 keys (rows) apart, blocks of
// 64 query rows Bc rows apart.
#define DQ_A_STEP (16 * SWZ_ROW_BYTES)
#define DQ_A_LBO (B90_BC * SWZ_ROW_BYTES)
#define DQ_JIT false

static_assert(HEAD_DIM <= 128 && HEAD_DIM % 32 == 0, "dK/dV of 64 keys in one warpgroup's registers");
static_assert(B90_BR % 64 == 0 && B90_BR <= 128, "query tile: whole swizzle blocks of dS^T, a wgmma N");
static_assert(B90_WGS == 2 || B90_WGS == 3, "warpgroups of a block: 2 or 3");
static_assert(DQ_N0 % 32 == 0 && DQ_N1 % 32 == 0 && (DQ_N0 % SWZ_COLS == 0 || DQ_N0 + DQ_N1 <= SWZ_COLS),
              "dQ column split: wgmma N of 32 or 64 inside whole swizzle blocks");

#else  // HEAD_DIM > 128
// ============================================ head dim 192, 256: Pij, dSij through shared memory
// dKj and dVj of 64 keys x HEAD_DIM would not fit one warpgroup's registers,
// so here the products are arranged differently.  Bc = 64 keys, Br = 64 query
// rows.  Sij and dPij (64 x 64, rows x keys) are split by keys: warpgroup w
// computes keys 32w..32w+31 of both, so Pij and dSij of an element meet in
// one thread in float32; both are rounded into shared memory ([row][key]).
// The products whose N is the head dim are split by columns; both
// warpgroups run the same instructions (wgmma wants warpgroup-uniform code):
//   dVj[:, c] += Pij^T dOi[:, c],  dKj[:, c] += dSij^T Qi[:, c]
//       (Pij^T, dSij^T: MN-major A operands; dOi, Qi: MN-major B operands)
//       on KV_N = 128 columns from KV_C0 * w: at head dim 256 the halves;
//       at 192 columns [0, 128) and [64, 192), warpgroup 1 storing only its
//       last 64 (a wgmma operand cannot start inside a swizzle block and
//       cross into the next, so 96 + 96 is not possible);
//   dQi[:, c] += dSij Kj[:, c]     (dSij: K-major A), DQ_CHUNKS products of
//       DQ_CHUNK columns per warpgroup, each within one swizzle block.
// Per thread: dKj, dVj as KV_N/2 floats each (64 keys x its columns).
// Shared memory (swizzled): Kj, Vj [HD_ATOMS][Bc][64]; Qi, dOi [2 stages]
// [HD_ATOMS][Br][64]; Pij, dSij [Br][64]; Li, Di [2 stages][Br].

#define B90_BC 64
#define KV_N 128                      // dKj, dVj columns computed per warpgroup
#define KV_C0 (HEAD_DIM - KV_N)       // first of them in warpgroup 1
#define KV_REGS (KV_N / 2)            // dKj, dVj floats per thread
#if HEAD_DIM % 128 == 0
#define DQ_CHUNK 64                   // dQi columns per product
#else
#define DQ_CHUNK 32
#endif
#define DQ_CHUNKS (HEAD_DIM / (2 * DQ_CHUNK))  // products per warpgroup
// dQi's A operand, dSij: K-major, k steps 16 keys (32 bytes) apart; its
// descriptors formed just in time (see wgmma_over_head_dim).
#define DQ_A_STEP (16 * 2)
#define DQ_A_LBO 16
#define DQ_JIT true

static_assert(B90_BR == 64 && B90_BC == 64, "Pij and dSij are one 64 x 64 swizzle block each");
static_assert(HEAD_DIM > 128 && HEAD_DIM <= 256 && HEAD_DIM % 64 == 0, "whole swizzle blocks of columns");

// dX[:, c0:c0+N] += A^T B[:, c0:c0+N]: A^T = Pij^T or dSij^T from the
// [Br][64] tile at a_addr (MN-major, keys contiguous), B = dOi or Qi from the
// stage at b_addr (MN-major); Br/16 k steps over the query rows.
template <int N>
__device__ __forceinline__ void issue_kv(float (&d)[N / 2], u32 a_addr, u32 b_addr, int c0) {
#pragma unroll
    for (int kk = 0; kk < B90_BR / 16; ++kk)
        wgmma_ss_ta_tb(d, smem_desc_sw128(a_addr + kk * 16 * SWZ_ROW_BYTES, B90_BR * SWZ_ROW_BYTES),
                       smem_desc_sw128(b_addr + (c0 / SWZ_COLS) * B90_BR * SWZ_ROW_BYTES + kk * 16 * SWZ_ROW_BYTES,
                                       B90_BR * SWZ_ROW_BYTES),
                       1);
}

#endif

// dQi[:, c0:c0+NC] += scale * dSij Kj[:, c0:c0+NC] for this warpgroup (its
// query rows mrow.. of the tile at i0), into the staging tile dQs or, where
// that is nullptr, straight into the float32 accumulator: A =
// dSij (k step kk at a_addr + kk * DQ_A_STEP; dSij^T, MN-major, up to head
// dim 128), B = Kj (MN-major), Bc/16 k steps over the keys.
template <int NC>
__device__ __forceinline__ void dq_product(float *dQacc, float *dQs, i64 row_base, int i0, int mrow, int Nq, int D,
                                           float scale, u32 a_addr, u32 k_addr, int c0, int warp_in_wg, int g, int t) {
    if (DQ_JIT) asm volatile("" : "+r"(a_addr), "+r"(k_addr));
    float dq[NC / 2];
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < B90_BC / 16; ++kk)
#if HEAD_DIM <= 128
        wgmma_ss_ta_tb(
#else
        wgmma_ss_tb(
#endif
            dq, smem_desc_sw128(a_addr + kk * DQ_A_STEP, DQ_A_LBO),
            smem_desc_sw128(
                k_addr + (c0 / SWZ_COLS) * B90_BC * SWZ_ROW_BYTES + kk * 16 * SWZ_ROW_BYTES + (c0 % SWZ_COLS) * 2,
                B90_BC * SWZ_ROW_BYTES),
            kk > 0);
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_hold(dq);
    const int i_w = mrow + 16 * warp_in_wg + g;  // this thread's first row in the tile (and i_w + 8)
    if (dQs != nullptr)
        dq_stage_rows<NC>(dQs, i_w, scale, c0, dq, t);
    else
        dq_add_rows<NC>(dQacc, row_base, i0 + i_w, Nq, D, scale, c0, dq, t);
}

// flash_bwd_dkdv_kernel (its parameters: FLASH_BWD_DKDV_KERNEL, flash_bwd_rows.cuh).
// Shared memory (the layout below): Kj, Vj; Qi, dOi in two stages; dSij^T
// (Pij and dSij above head dim 128); Li, Di in two stages; the dQi staging
// tile (up to head dim 128); alignment slack.
LAUNCH_SHAPE(flash_bwd_dkdv_kernel, B90_THREADS, B90_BC,
             ((2 * B90_BC + 4 * B90_BR) * HDP + (HEAD_DIM <= 128 ? 1 : 2) * B90_BC * B90_BR) * sizeof(elem_t) +
                 (4 * B90_BR + DQS_FLOATS) * sizeof(float) + SMEM_ALIGN);
TILE_MAP(flash_bwd_dkdv_kernel, B90_BR, B90_BC);
FLASH_BWD_DKDV_KERNEL(B90_THREADS) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    elem_t *Kj = reinterpret_cast<elem_t *>(swizzle_base(smem_raw));  // [HD_ATOMS][Bc][64]
    elem_t *Vj = Kj + B90_BC * HDP;                                     // [HD_ATOMS][Bc][64]
    elem_t *Qs = Vj + B90_BC * HDP;                                     // [2][HD_ATOMS][Br][64]
    elem_t *dOs = Qs + 2 * B90_BR * HDP;                                // [2][HD_ATOMS][Br][64]
#if HEAD_DIM <= 128
    elem_t *dSt = dOs + 2 * B90_BR * HDP;                               // [Br/64][Bc][64]: dSij^T
    float *Ls = reinterpret_cast<float *>(dSt + B90_BC * B90_BR);       // [2][Br], Li * log2(e)
#else
    elem_t *Ps = dOs + 2 * B90_BR * HDP;                                // [Br][64]: Pij
    elem_t *dSs = Ps + B90_BR * B90_BC;                                 // [Br][64]: dSij
    float *Ls = reinterpret_cast<float *>(dSs + B90_BR * B90_BC);       // [2][Br], Li * log2(e)
#endif
    float *Ds = Ls + 2 * B90_BR;                                        // [2][Br]
    float *dQs = Ds + 2 * B90_BR;  // [DQ_STAGES][Br][DQS_LD]: dQi for the copy engine (16-byte aligned: Br even)

    const int tid = threadIdx.x, wg = tid / WG_THREADS, lane = tid % WARP_SIZE;
    const int warp_in_wg = (tid % WG_THREADS) / WARP_SIZE;
    const int g = lane >> 2, t = lane & 3;
    const KeyTile<elem_t> blk = key_tile<B90_BC, B90_BR>(Q, dO, mask, tmap, key_lengths, Nq, Nk, args);
    const int tr_begin = blk.qt.begin, tr_end = blk.qt.end;
    // dQi through the staging tiles and the copy engine (see the top of the
    // file); thread 0 issues the reductions.  staged_i0: the first row of the
    // query tile whose dQi waits in buffer staged_buf to be reduced (-1: none).
    const bool dq_bulk = DQS_FLOATS > 0 && dQacc != nullptr && D == HEAD_DIM;
    const bool dq_issuer = dq_bulk && tid == 0;
    int staged_i0 = -1, staged_buf = 0;
    auto reduce_staged = [&]() {
        if (dq_issuer && staged_i0 >= 0) {
            bulk_reduce_add_f32(dQacc + (blk.row_base + staged_i0) * D, dQs + staged_buf * B90_BR * DQS_LD,
                                (u32)(min(B90_BR, Nq - staged_i0) * D * sizeof(float)));
            bulk_commit();
        }
    };

#if HEAD_DIM <= 128
    const int k_last = min(blk.k0 + B90_BC, blk.mp.kl) - 1;  // (last key of this tile)

    // Shared addresses of the operands.
    const u32 k_addr = smem_addr(Kj), v_addr = smem_addr(Vj), q_addr0 = smem_addr(Qs), do_addr0 = smem_addr(dOs);
    const u32 ds_addr = smem_addr(dSt);
    const u32 kw_addr = k_addr + 64 * wg * SWZ_ROW_BYTES, vw_addr = v_addr + 64 * wg * SWZ_ROW_BYTES;
    constexpr u32 QD_STAGE_BYTES = B90_BR * HDP * 2;
    const int key_w = 64 * wg + 16 * warp_in_wg + g;  // this thread's first key in the tile (and key_w + 8)
    // Whether any of this warpgroup's 64 keys is below the key length (the
    // last key tile of a sequence may be partly empty: its empty warpgroups
    // skip their products and only take part in dQi and the barriers).
    const bool wg_live = blk.k0 + 64 * wg <= k_last;

#else
    const u32 k_addr = smem_addr(Kj), v_addr = smem_addr(Vj), q_addr0 = smem_addr(Qs), do_addr0 = smem_addr(dOs);
    const u32 p_addr = smem_addr(Ps), ds_addr = smem_addr(dSs);
    const u32 kw_addr = k_addr + 32 * wg * SWZ_ROW_BYTES, vw_addr = v_addr + 32 * wg * SWZ_ROW_BYTES;
    constexpr u32 QD_STAGE_BYTES = B90_BR * HDP * 2;
    const int c0 = KV_C0 * wg;                     // first dKj, dVj column of this warpgroup
    const int row_t = 16 * warp_in_wg + g;         // this thread's first row of Sij (and row_t + 8)
    const int key_t = 32 * wg + 2 * t;             // its first key column of Sij (+ 8n, + 1)

#endif
    float dv[KV_REGS], dk[KV_REGS];
#pragma unroll
    for (int i = 0; i < KV_REGS; ++i) dv[i] = dk[i] = 0.f;

    // Query tile `tr` (its Qi, dOi, Li, Di) into stage `st`.
    auto load_q_tile = [&](int tr, int st) {
        const int i0 = tr * B90_BR;
        load_tile<B90_BR, B90_THREADS, SWIZZLED>(Qs + st * B90_BR * HDP, blk.Qg, args.q_sn, i0, Nq, D, args.vec, tid);
        load_tile<B90_BR, B90_THREADS, SWIZZLED>(dOs + st * B90_BR * HDP, blk.dOg, args.do_sn, i0, Nq, D, args.vec,
                                                 tid);
        if (tid < B90_BR) {
            const bool ok = i0 + tid < Nq;
            cp_async4(Ls + st * B90_BR + tid, ok ? L2vec + blk.row_base + i0 + tid : L2vec, ok);
            cp_async4(Ds + st * B90_BR + tid, ok ? Dvec + blk.row_base + i0 + tid : Dvec, ok);
        }
    };

#if HEAD_DIM <= 128
    // dSij^T rows of this thread's keys in shared memory, for dQi.
    auto store_dsT = [&](const u32 (&ds)[B90_BR / 16][4]) {
#pragma unroll
        for (int kk = 0; kk < B90_BR / 16; ++kk)
#pragma unroll
            for (int half = 0; half < 2; ++half)
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const int row = 16 * kk + 8 * half + 2 * t;
                    *reinterpret_cast<u32 *>(dSt + swz<B90_BC>(key_w + 8 * r, row)) = ds[kk][2 * half + r];
                }
    };
    if (!wg_live && dQacc != nullptr) {
        // A warpgroup without keys below the key length adds nothing to dQi:
        // its rows of dSij^T are zero for the whole query loop (the loop's
        // first barrier publishes them).
        const u32 zero[B90_BR / 16][4] = {};
        store_dsT(zero);
    }

#endif
    // The block map's entries of this key tile (query tiles kinds_stride
    // apart), kept in shared memory for the registers' sake (the loop's first
    // barrier publishes them).
    __shared__ const unsigned char *kinds;
    __shared__ int kinds_stride;
    if (tid == 0) kinds = map_col(blk.mp, blockIdx.z), kinds_stride = map_stride(blk.mp);
    if (tr_begin < tr_end) {
        load_block_kv<B90_BC, B90_THREADS, SWIZZLED>(Kj, Vj, K, V, blk, args, Nq, D, tid);
        load_q_tile(tr_begin, 0);
        cp_async_commit();
    }

    for (int tr = tr_begin, it = 0, tr_next; tr < tr_end; tr = tr_next, ++it) {
        const int i0 = tr * B90_BR;
        const int st = it & 1;
        cp_async_wait<0>();  // this thread's part of Qi, dOi, Li, Di (and Kj, Vj) has landed
        fence_proxy_async();
        // Every thread's loads are visible to all threads and the tensor cores;
        // every warpgroup is done with the other stage (tile it-1) and with dSij^T
        // (Pij and dSij above head dim 128); tile it-1's dQi is staged.
        __syncthreads();
        reduce_staged();  // (tile it-1's dQi, under this tile's products)
        staged_i0 = dq_bulk ? i0 : -1;
        staged_buf = it % DQ_STAGES;
        tr_next = next_tile(kinds, kinds_stride, tr + 1, tr_end);  // (the tile to prefetch)
        if (tr_next < tr_end) load_q_tile(tr_next, st ^ 1);
        cp_async_commit();

        const u32 q_addr = q_addr0 + st * QD_STAGE_BYTES, do_addr = do_addr0 + st * QD_STAGE_BYTES;
        const float *Li = Ls + st * B90_BR, *Di = Ds + st * B90_BR;

#if HEAD_DIM <= 128
        u32 pT[B90_BR / 16][4], dsT[B90_BR / 16][4];
        if (wg_live) {
            // Sij^T = Kj Qi^T and dPij^T = Vj dOi^T for this warpgroup's 64 keys.
            float sT[ST_REGS], dpT[ST_REGS];
            wgmma_fence();
            wgmma_over_head_dim<B90_BC, B90_BR>(sT, kw_addr, q_addr);
            wgmma_commit();
            wgmma_over_head_dim<B90_BC, B90_BR>(dpT, vw_addr, do_addr);
            wgmma_commit();
            wgmma_wait<1>();  // Sij^T is done (dPij^T may still run)
            wgmma_hold(sT);

            // Pij^T = exp2(Sij^T * scale * log2(e) + bias - Li): column = query row.
            // A row that sees no key (Li = -inf) subtracts +inf instead, so that
            // its Pij^T is exp2(-inf) = 0.  Two loops (a warp-uniform branch), so
            // that a tile without tests or score modifier pays one FFMA per score.
#if SCORE_MOD
            float slope[ST_REGS];  // the score modifier's slope at each Sij^T, for dSij^T
#endif
            const bool need_mask =
                tile_needs_mask(blk.mp, i0, B90_BR, blk.k0 + 64 * wg, 64, map_kind(kinds, (i64)tr * kinds_stride));
            if (SCORE_MOD || need_mask) {
#pragma unroll
                for (int n = 0; n < B90_BR / 8; ++n)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int row = 8 * n + 2 * t + (e & 1);
                        const float l2 = Li[row], base = (l2 == NEG_INF) ? -NEG_INF : l2;
#if SCORE_MOD
                        slope[4 * n + e] = score_slope(sT[4 * n + e], blk.mp, blk.mask_bh, i0 + row,
                                                       blk.k0 + key_w + 8 * (e >> 1));
#endif
                        sT[4 * n + e] = exp2_fast(tile_score(sT[4 * n + e], need_mask, args.scale_log2, blk.mp,
                                                             blk.mask_bh, i0 + row, blk.k0 + key_w + 8 * (e >> 1)) -
                                                  base);
                    }
            } else {
#pragma unroll
                for (int n = 0; n < B90_BR / 8; ++n)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const float l2 = Li[8 * n + 2 * t + (e & 1)], base = (l2 == NEG_INF) ? -NEG_INF : l2;
                        sT[4 * n + e] = exp2_fast(fmaf(sT[4 * n + e], args.scale_log2, -base));
                    }
            }
            wgmma_wait<0>();  // dPij^T is done
            wgmma_hold(dpT);

            // dSij^T = Pij^T o (dPij^T - Di) (through the score modifier); both
            // rounded into A fragments (k step kk = query rows 16kk..16kk+15).
#pragma unroll
            for (int n = 0; n < B90_BR / 8; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e)
#if SCORE_MOD
                    dpT[4 * n + e] = through_score_mod(sT[4 * n + e] * (dpT[4 * n + e] - Di[8 * n + 2 * t + (e & 1)]),
                                                       slope[4 * n + e]);
#else
                    dpT[4 * n + e] = sT[4 * n + e] * (dpT[4 * n + e] - Di[8 * n + 2 * t + (e & 1)]);
#endif
            pack_frags(pT, sT);
            pack_frags(dsT, dpT);

            // dVj += Pij^T dOi, dKj += dSij^T Qi (dOi, Qi as MN-major B operands).
            wgmma_fence();
            wgmma_regs_a(dv, pT, do_addr);
            wgmma_regs_a(dk, dsT, q_addr);
            wgmma_commit();
        }

        if (dQacc != nullptr) {
            // dSij^T into shared memory (row pairs of one key as 32-bit
            // stores); an empty warpgroup's rows are zero from the start.
            if (wg_live) store_dsT(dsT);
            fence_proxy_async();
            // (the copy engine has read tile it-2's dQi from this tile's buffer)
            if (dq_issuer) bulk_wait_read<DQ_STAGES - 1>();
            // dSij^T of both warpgroups is visible to the tensor cores; this
            // tile's dQs buffer is free.
            __syncthreads();
            float *const stage = dq_bulk ? dQs + staged_buf * B90_BR * DQS_LD : nullptr;
#pragma unroll
            for (int mblk = 0; mblk < B90_BR / 64; ++mblk) {
                const u32 a_addr = ds_addr + mblk * B90_BC * SWZ_ROW_BYTES;  // dSij^T of query rows 64 mblk..
                if (wg == 0)
                    dq_product<DQ_N0>(dQacc, stage, blk.row_base, i0, 64 * mblk, Nq, D, args.scale, a_addr, k_addr, 0,
                                      warp_in_wg, g, t);
                else if (B90_WGS == 2 || wg == 1)  // (a third warpgroup computes no dQi)
                    dq_product<DQ_N1>(dQacc, stage, blk.row_base, i0, 64 * mblk, Nq, D, args.scale, a_addr, k_addr,
                                      DQ_N0, warp_in_wg, g, t);
            }
            if (dq_bulk) fence_proxy_async();  // (this thread's part of dQs, for the copy engine)
        }
        wgmma_wait<0>();  // dVj, dKj products are done: pT, dsT free
        wgmma_hold(dv);
        wgmma_hold(dk);
        hold_frag(pT);
        hold_frag(dsT);
#else
        // Sij = Qi Kj^T and dPij = dOi Vj^T for this warpgroup's 32 keys.
        float s[16], dp[16];
        wgmma_fence();
        wgmma_over_head_dim<B90_BR, B90_BC, true>(s, q_addr, kw_addr);
        wgmma_commit();
        wgmma_over_head_dim<B90_BR, B90_BC, true>(dp, do_addr, vw_addr);
        wgmma_commit();
        wgmma_wait<1>();  // Sij is done (dPij may still run)
        wgmma_hold(s);

        // Pij = exp2(Sij * scale * log2(e) + bias - Li).
        const float l2[2] = {Li[row_t], Li[row_t + 8]};
        const bool need_mask =
            tile_needs_mask(blk.mp, i0, B90_BR, blk.k0 + 32 * wg, 32, map_kind(kinds, (i64)tr * kinds_stride));
#if SCORE_MOD
        float slope[16];  // the score modifier's slope at each Sij, for dSij
#endif
#pragma unroll
        for (int n = 0; n < 4; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int row = i0 + row_t + 8 * (e >> 1), key = blk.k0 + key_t + 8 * n + (e & 1);
#if SCORE_MOD
                slope[4 * n + e] = score_slope(s[4 * n + e], blk.mp, blk.mask_bh, row, key);
#endif
                const float x = tile_score(s[4 * n + e], need_mask, args.scale_log2, blk.mp, blk.mask_bh, row, key);
                s[4 * n + e] = (l2[e >> 1] == NEG_INF) ? 0.f : exp2_fast(x - l2[e >> 1]);
            }
        wgmma_wait<0>();  // dPij is done
        wgmma_hold(dp);

        // dSij = Pij o (dPij - Di) (through the score modifier); Pij and dSij
        // rounded into shared memory.
        const float di[2] = {Di[row_t], Di[row_t + 8]};
#pragma unroll
        for (int n = 0; n < 4; ++n)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int off = swz<B90_BR>(row_t + 8 * r, key_t + 8 * n);
                const float p0 = s[4 * n + 2 * r], p1 = s[4 * n + 2 * r + 1];
                float ds0 = p0 * (dp[4 * n + 2 * r] - di[r]), ds1 = p1 * (dp[4 * n + 2 * r + 1] - di[r]);
#if SCORE_MOD
                ds0 = through_score_mod(ds0, slope[4 * n + 2 * r]);
                ds1 = through_score_mod(ds1, slope[4 * n + 2 * r + 1]);
#endif
                *reinterpret_cast<u32 *>(Ps + off) = pack2(p0, p1);
                *reinterpret_cast<u32 *>(dSs + off) = pack2(ds0, ds1);
            }
        fence_proxy_async();
        // Pij and dSij of both warpgroups are visible to the tensor cores.
        __syncthreads();

        // dVj += Pij^T dOi, dKj += dSij^T Qi on this warpgroup's columns.
        wgmma_fence();
        issue_kv<KV_N>(dv, p_addr, do_addr, c0);
        issue_kv<KV_N>(dk, ds_addr, q_addr, c0);
        wgmma_commit();

        // dQi += scale * dSij Kj on this warpgroup's half of the columns.
        if (dQacc != nullptr) {
#pragma unroll 1
            for (int c = 0; c < DQ_CHUNKS; ++c)
                dq_product<DQ_CHUNK>(dQacc, nullptr, blk.row_base, i0, 0, Nq, D, args.scale, ds_addr, k_addr,
                                     (HEAD_DIM / 2) * wg + DQ_CHUNK * c, warp_in_wg, g, t);
        }
        wgmma_wait<0>();  // the dVj, dKj products are done
        wgmma_hold(dv);
        wgmma_hold(dk);
#endif
    }

    // The last query tile's dQi, staged by every thread, goes to the copy
    // engine; the block waits until the engine is done with it.
    if (staged_i0 >= 0) {
        // Every thread's part of the last tile's dQi is in dQs.
        __syncthreads();
        reduce_staged();
        if (dq_issuer) bulk_wait<0>();
    }

    // Write dKj (scaled) and dVj; key tiles no query sees get zeros.
    elem_t *dKg = dK + (i64)blk.b * args.dkh_sb + (i64)blk.h * args.dkh_sh;
    elem_t *dVg = dV + (i64)blk.b * args.dvh_sb + (i64)blk.h * args.dvh_sh;
#if HEAD_DIM <= 128
    store_kv<HEAD_DIM>(dKg, dVg, args.dkh_sn, args.dvh_sn, dk, dv, args.scale, blk.k0 + key_w, Nk, D, 0, 0, t,
                       args.vec);
#else
    store_kv<KV_N>(dKg, dVg, args.dkh_sn, args.dvh_sn, dk, dv, args.scale, blk.k0 + 16 * warp_in_wg + g, Nk, D, c0,
                   wg == 0 ? 0 : KV_N,
                   t, args.vec);
#endif
}
