// flash_fwd_mma.cuh -- the FlashAttention forward kernel of the mma.sync
// passes, float32 (flash_fwd.cu) and float16 / bfloat16 (flash_fwd_f16.cu).
//
// Algorithm: FlashAttention-2 forward (Dao, "FlashAttention-2: Faster Attention
// with Better Parallelism and Work Partitioning", 2023, Algorithm 1).  Each
// block owns one query tile Qi (Br rows) of one (batch, head) and streams the
// key/value tiles Kj, Vj (Bc rows) through shared memory; the running row
// maximum mi, row sum li and the unnormalised output Oi stay in float32
// registers (online softmax).  At the end Oi /= li and Li = mi + log(li)
// (the log-sum-exp the backward pass needs) are written.
//
// Assumptions: q (B,H,Nq,D), k/v (B,H,Nk,D), o like q in elem_t, lse
// (B,H,Nq) float32, last dimension contiguous, any other strides; D <=
// HEAD_DIM (zero-filled to HEAD_DIM in shared memory).  Any Nq, Nk >= 1.
//
// Tile layout: FWD_WARPS warps, warp w owns FWD_MT row blocks of 16 rows, so
// Br = 16 * FWD_MT * FWD_WARPS; Bc = BC keys per step.  Shared memory:
// Qi[Br][LDH], Kj[Bc][LDH], Vj[Bc][LDH].  Kj and Vj are single buffers whose
// loads overlap compute: Vj loads while Sij = Qi Kj^T and the softmax run,
// K(j+1) loads while Oi += Pij Vj runs.  Per warp: Sij as 16 x Bc C
// fragments (Bc/2 floats a thread per row block), Oi as 16 x HEAD_DIM
// (HEAD_DIM/2 floats); a thread holds rows g and g+8 of each row block
// (g = lane/4), so a row's statistics reduce over the 4 lanes of a quad.
// Scores are in log2 units (scale * log2(e) folded in) and exponentiated
// with exp2 (softmax_exp2).
//
// Masks: the causal/window/key-length band is a run-time [lo, hi] diagonal
// range per row; key tiles outside it are skipped, tiles inside it are not
// masked element-wise, only boundary tiles are.  MASK_MODE adds a dense bool
// or float mask; a bool mask's block map (tmap) skips the tiles it leaves
// empty and spares the full ones the per-element test.  A row that sees no
// key ends with li = 0: Oi = 0, Li = -inf.
//
// The products: float32 as split TF32 (flash_common.cuh's warp_mma, Sij over
// the 8-wide k steps that hold real head-dim columns); 16-bit as
// mma.sync.m16n8k16 over the whole padded head dim (K_STEPS steps of 16,
// the fragments of step ks + 1 loaded while step ks runs, except with
// LEAN_REGISTERS), Pij rounded to elem_t for Pij Vj.  The pass defines
// FWD_MT (16-row blocks per warp) and FWD_MIN_BLOCKS before including this
// header.

#pragma once

#ifndef FWD_WARPS
#error "FWD_WARPS must be defined (pycudaflash.compiler.defines)"
#endif
#ifndef BC
#error "BC must be defined (pycudaflash.compiler.defines)"
#endif
#define FWD_THREADS (FWD_WARPS * WARP_SIZE)
#define BR (16 * FWD_MT * FWD_WARPS)
#define S_TILES (BC / 8)         // 8-wide score tiles per row block
#define O_TILES (HEAD_DIM / 8)   // 8-wide output tiles
#define K_STEPS (HEAD_DIM / 16)  // 16-wide k steps over the head dim (16-bit products)

static_assert(BC % 16 == 0, "key tile is a whole number of 16-wide k steps");

// Shared memory: Qi [BR][LDH], Kj and Vj [BC][LDH].
LAUNCH_SHAPE(flash_fwd_kernel, FWD_THREADS, BR, (BR + 2 * BC) * LDH * sizeof(elem_t));
TILE_MAP(flash_fwd_kernel, BR, BC);

extern "C" __global__ void __launch_bounds__(FWD_THREADS, FWD_MIN_BLOCKS)
flash_fwd_kernel(const elem_t *__restrict__ Q, const elem_t *__restrict__ K, const elem_t *__restrict__ V,
                 elem_t *__restrict__ O, float *__restrict__ LSE, const void *__restrict__ mask,
                 const unsigned char *__restrict__ tmap, const int *__restrict__ key_lengths, int Nq, int Nk, int D,
                 const __grid_constant__ AttnParams args) {
    extern __shared__ __align__(16) smem_t smem_raw[];
    elem_t *Qi = reinterpret_cast<elem_t *>(smem_raw);  // [BR][LDH]
    elem_t *Kj = Qi + BR * LDH;                         // [BC][LDH]
    elem_t *Vj = Kj + BC * LDH;                         // [BC][LDH]

    const int tid = threadIdx.x, warp = tid / WARP_SIZE, lane = tid % WARP_SIZE;
    const int g = lane >> 2, t = lane & 3;
    const int h = blockIdx.y, b = blockIdx.z;
    // Launch the last query tiles first: under a causal mask they are the longest.
    const int q0 = (gridDim.x - 1 - blockIdx.x) * BR;

    const MaskParams mp = mask_params<BR, BC>(mask, tmap, args, key_length(key_lengths, b, Nk), Nq, Nk, b, h);
    const char *mask_bh = mask_head_base(mp, b, h);

    const elem_t *Qg = Q + (i64)b * args.q_sb + (i64)h * args.q_sh;
    const int hk = kv_head(h, args.kv_group);  // the K/V head this query head reads
    const elem_t *Kg = K + (i64)b * args.k_sb + (i64)hk * args.k_sh;
    const elem_t *Vg = V + (i64)b * args.v_sb + (i64)hk * args.v_sh;

    // Keys any row of this tile may see; of their tiles, those the block map
    // leaves (tc_begin: the first).  The map's entries of this query tile are
    // kept in shared memory: the registers go to the products (the loop's
    // first barrier publishes them).
    const TileRange kt = key_tiles(q0, BR, Nq, mp.kl, args.band_lo, args.band_hi, BC);
    const KeyRange kr = seen_keys(q0, BR, Nq, mp.kl, args.band_lo, args.band_hi, mask_seen(mp));  // (the rest zero-filled)
    const int tc_begin = next_tile(map_row(mp, q0 / BR), 1, kt.begin, kt.end), tc_end = kt.end;
    __shared__ const unsigned char *kinds;
    if (tid == 0) kinds = map_row(mp, q0 / BR);

    float o_acc[FWD_MT][O_TILES][4];
#pragma unroll
    for (int mt = 0; mt < FWD_MT; ++mt)
#pragma unroll
        for (int n = 0; n < O_TILES; ++n) o_acc[mt][n][0] = o_acc[mt][n][1] = o_acc[mt][n][2] = o_acc[mt][n][3] = 0.f;
    float m_i[FWD_MT][2], l_i[FWD_MT][2];  // running row max (log2 units), row sum (own columns)
#pragma unroll
    for (int mt = 0; mt < FWD_MT; ++mt) m_i[mt][0] = m_i[mt][1] = NEG_INF, l_i[mt][0] = l_i[mt][1] = 0.f;

#if ELEM_F32
    const int ksteps = (D + 7) / 8;        // 8-wide k steps that hold real head-dim columns
#endif
    const int row_w = 16 * FWD_MT * warp;  // first row of this warp in the tile

    if (tc_begin < tc_end) {
        // Load Qi and the first Kj.
        load_tile<BR, FWD_THREADS>(Qi, Qg, args.q_sn, q0, Nq, D, args.vec, tid);
        load_tile<BC, FWD_THREADS>(Kj, Kg, args.k_sn, tc_begin * BC, kr.hi, D, args.vec, tid, kr.lo, range_bits(kr));
        cp_async_commit();
    }

    for (int tc = tc_begin; tc < tc_end; tc = next_tile(kinds, 1, tc + 1, tc_end)) {
        const int k0 = tc * BC;
        cp_async_wait<0>();
        // Qi and Kj have landed for every thread; every warp is also done with
        // the previous Vj, so it may be overwritten now.
        __syncthreads();
        load_tile<BC, FWD_THREADS>(Vj, Vg, args.v_sn, k0, kr.hi, D, args.vec, tid, kr.lo, range_bits(kr));
        cp_async_commit();

        // Sij = Qi Kj^T (16 x BC per row block; zero-filled head-dim columns
        // past D add nothing).
        float s[FWD_MT][S_TILES][4];
#pragma unroll
        for (int mt = 0; mt < FWD_MT; ++mt)
#pragma unroll
            for (int n = 0; n < S_TILES; ++n) s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.f;
#if ELEM_F32
        warp_mma<1, S_TILES, false>(
            s, [&](int m, int k) { return Qi[(row_w + m) * LDH + k]; },
            [&](int k, int n) { return Kj[n * LDH + k]; }, ksteps, BC, lane);
#elif LEAN_REGISTERS
#pragma unroll 1
        for (int ks = 0; ks < K_STEPS; ++ks)
            mma_kstep<FWD_MT, S_TILES / 2, false>(s, Qi, LDH, row_w, Kj, LDH, 0, 16 * ks, lane);
#else
        {  // (fragments of k step ks + 1 load while the products of step ks run)
            u32 a[2][FWD_MT][4], bf[2][S_TILES / 2][4];
#pragma unroll
            for (int mt = 0; mt < FWD_MT; ++mt) load_a(a[0][mt], Qi, LDH, row_w + 16 * mt, 0, lane);
#pragma unroll
            for (int np = 0; np < S_TILES / 2; ++np) load_b_nk(bf[0][np], Kj, LDH, 16 * np, 0, lane);
#pragma unroll
            for (int ks = 0; ks < K_STEPS; ++ks) {
                const int cur = ks & 1;
                if (ks + 1 < K_STEPS) {
#pragma unroll
                    for (int mt = 0; mt < FWD_MT; ++mt)
                        load_a(a[cur ^ 1][mt], Qi, LDH, row_w + 16 * mt, 16 * (ks + 1), lane);
#pragma unroll
                    for (int np = 0; np < S_TILES / 2; ++np)
                        load_b_nk(bf[cur ^ 1][np], Kj, LDH, 16 * np, 16 * (ks + 1), lane);
                }
#pragma unroll
                for (int np = 0; np < S_TILES / 2; ++np)
#pragma unroll
                    for (int mt = 0; mt < FWD_MT; ++mt)
                        mma16816_x2(s[mt][2 * np], s[mt][2 * np + 1], a[cur][mt], bf[cur][np]);
            }
        }
#endif

        // Scale to log2 units and apply the masks on boundary tiles.
        const bool need_mask = tile_needs_mask(mp, q0, BR, k0, BC, map_kind(kinds, tc));
#pragma unroll
        for (int mt = 0; mt < FWD_MT; ++mt)
#pragma unroll
            for (int n = 0; n < S_TILES; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int i = q0 + row_w + 16 * mt + g + 8 * (e >> 1);
                    const int j = k0 + 8 * n + 2 * t + (e & 1);
                    s[mt][n][e] = tile_score(s[mt][n][e], need_mask, args.scale_log2, mp, mask_bh, i, j);
                }

        // Online softmax: new row max mi, rescale factor, Pij = exp2(Sij - mi).
#pragma unroll
        for (int mt = 0; mt < FWD_MT; ++mt)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float mx = m_i[mt][r];
#pragma unroll
                for (int n = 0; n < S_TILES; ++n) mx = fmaxf(mx, fmaxf(s[mt][n][2 * r], s[mt][n][2 * r + 1]));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                // A row that has seen only masked keys keeps mi = -inf; use 0 as the
                // exponent base so that exp2(-inf - base) = 0 and nothing is NaN.
                const float base = (mx == NEG_INF) ? 0.f : mx;
                const float alpha = softmax_exp2(m_i[mt][r] - base);
                m_i[mt][r] = mx;
                float rowsum = 0.f;
#pragma unroll
                for (int n = 0; n < S_TILES; ++n) {
                    s[mt][n][2 * r] = softmax_exp2(s[mt][n][2 * r] - base);
                    s[mt][n][2 * r + 1] = softmax_exp2(s[mt][n][2 * r + 1] - base);
                    rowsum += s[mt][n][2 * r] + s[mt][n][2 * r + 1];
                }
                l_i[mt][r] = l_i[mt][r] * alpha + rowsum;
#pragma unroll
                for (int n = 0; n < O_TILES; ++n) {
                    o_acc[mt][n][2 * r] *= alpha;
                    o_acc[mt][n][2 * r + 1] *= alpha;
                }
            }

        cp_async_wait<0>();
        // Vj has landed; every warp is also done reading Kj.
        __syncthreads();
        const int tc_next = next_tile(kinds, 1, tc + 1, tc_end);
        if (tc_next < tc_end) {
            load_tile<BC, FWD_THREADS>(Kj, Kg, args.k_sn, tc_next * BC, kr.hi, D, args.vec, tid, kr.lo, range_bits(kr));
            cp_async_commit();
        }

#if ELEM_F32
        // Oi += Pij Vj (through fresh accumulators of 4 output tiles, see warp_mma_rega_add).
        warp_mma_rega_add<S_TILES, O_TILES, 4>(o_acc[0], s[0], [&](int k, int n) { return Vj[k * LDH + n]; }, lane);
#else
        // Oi += Pij Vj, Pij rounded to elem_t straight from the C fragments.
#pragma unroll
        for (int kk = 0; kk < BC / 16; ++kk) {
            u32 p[FWD_MT][4];
#pragma unroll
            for (int mt = 0; mt < FWD_MT; ++mt) pack_a(p[mt], s[mt][2 * kk], s[mt][2 * kk + 1]);
#pragma unroll
            for (int dp = 0; dp < O_TILES / 2; ++dp) {  // (zero-filled columns past D give zeros)
                u32 bf[4];
                load_b_kn(bf, Vj, LDH, 16 * dp, 16 * kk, lane);
#pragma unroll
                for (int mt = 0; mt < FWD_MT; ++mt) mma16816_x2(o_acc[mt][2 * dp], o_acc[mt][2 * dp + 1], p[mt], bf);
            }
        }
#endif
    }

    // Finish: li over the 4 lanes of a row, Oi /= li, Li = mi*ln2 + log(li).
    elem_t *Og = O + (i64)b * args.o_sb + (i64)h * args.o_sh;
#pragma unroll
    for (int mt = 0; mt < FWD_MT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r)
            store_out_row<O_TILES>(Og, args.o_sn, LSE, b, h, args.l_sb, args.l_sh, args.l_sn, q0 + row_w + 16 * mt + g,
                                   r, Nq, D, t, m_i[mt][r], l_i[mt][r], args.vec,
                                   [&](int n, int e) { return o_acc[mt][n][2 * r + e]; });
}
