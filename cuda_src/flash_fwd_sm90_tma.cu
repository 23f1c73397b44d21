// flash_fwd_sm90_tma.cu -- FlashAttention forward pass for Hopper (sm_90a)
// with a producer warp: the Tensor Memory Accelerator loads Qi, Kj and Vj,
// and the consumer warpgroups compute as in flash_fwd_sm90.cu.
//
// Algorithm: that of flash_fwd_sm90.cu (FlashAttention-2's forward with
// FlashAttention-3's wgmma products and intra-warpgroup overlap); what
// changes is who loads and how the warpgroups meet (FlashAttention-3,
// section 3.1, warp specialisation):
//   - the producer warpgroup keeps 24 registers a thread (setmaxnreg); one
//     of its threads issues the TMA copies of a job's Qi and of its Kj, Vj
//     into a ring of KV_STAGES stages;
//   - the consumer warpgroups take the registers it gave up, wait on a
//     stage's "full" barrier before reading it and arrive on its "empty"
//     barrier when their products have read it: no block-wide barrier in
//     the main loop, and the loads run as far ahead as the ring allows.
// Keys outside the band and the key length that a boundary tile holds, and
// keys that no row may see under the mask (the block map's seen-key bits),
// arrive from memory (the TMA copies whole boxes; only rows past Nk and
// columns past D are zero-filled): the consumers zero them in shared memory
// before the products read them, so that a NaN stored there never meets a
// zero probability (as the cp.async kernel's loads do).
//
// Assumptions: as flash_fwd_sm90.cu, and q, k, v described by tensor maps
// (pycudaflash._tma: 16-byte aligned base and strides, no broadcast
// dimension), args.q_map, k_map and v_map.  One job (query tile) a block:
// grid (Tr, H, B).
//
// Tile layout: as flash_fwd_sm90.cu for the FWD_WGS consumer warpgroups
// (threads 0 .. FWD_THREADS-1); the producer warpgroup is the last one.
// Shared memory (1024-byte aligned): Qi [HD_ATOMS][Br][64], Kj and Vj
// [KV_STAGES][HD_ATOMS][Bc][64], each 64-column block one TMA box in the
// 128-byte swizzle; the barriers are static shared memory.

#include "flash_fwd_sm90.cuh"

#if FWD_PERSIST || !FWD_TMA
#error "the TMA forward runs one job a block (FWD_PERSIST 0) with tensor maps (FWD_TMA 1)"
#endif
#define KV_STAGES 2
#define FWD_BLOCK_THREADS (FWD_THREADS + WG_THREADS)  // consumers, then the producer warpgroup
// Registers a thread: the producer's, and what the consumers may take of the
// 64K a block may hold (a multiple of 8).
#define PRODUCER_REGS 24
#define CONSUMER_REGS_RAW ((65536 - PRODUCER_REGS * WG_THREADS) / FWD_THREADS / 8 * 8)
#define CONSUMER_REGS (CONSUMER_REGS_RAW > 240 ? 240 : CONSUMER_REGS_RAW)
#define CONSUMERS_BARRIER 1  // named barrier of the consumer warpgroups (0 is __syncthreads)
#define Q_BYTES (HD_ATOMS * BR * SWZ_ROW_BYTES)
#define KV_BYTES (HD_ATOMS * BC * SWZ_ROW_BYTES)
static_assert(BR <= 256 && BC <= 256, "a TMA box has at most 256 rows");

// Zero the rows of a K or V stage (keys k0..k0+BC-1) outside the keys kr:
// whole 128-byte rows, whose chunks the swizzle only permutes.
__device__ __forceinline__ void zero_unseen_keys(elem_t *stage, int k0, KeyRange kr, int tid) {
    for (int c = tid; c < HD_ATOMS * BC * 8; c += FWD_THREADS) {
        const int key = k0 + (c / 8) % BC;
        if (key < kr.lo || key >= kr.hi || !bit_set(range_bits(kr), key))
            reinterpret_cast<uint4 *>(stage)[c] = make_uint4(0u, 0u, 0u, 0u);
    }
}

// Whether the tile of keys k0..k0+BC-1 holds keys outside kr.
__device__ __forceinline__ bool holds_unseen_keys(int k0, KeyRange kr) {
    return k0 < kr.lo || k0 + BC > kr.hi || !bits_all_set(range_bits(kr), k0, k0 + BC);
}

LAUNCH_SHAPE(flash_fwd_kernel, FWD_BLOCK_THREADS, BR, (BR + 2 * KV_STAGES * BC) * HDP * sizeof(elem_t) + SMEM_ALIGN);
TILE_MAP(flash_fwd_kernel, BR, BC);

extern "C" __global__ void __launch_bounds__(FWD_BLOCK_THREADS, 1)
flash_fwd_kernel(elem_t *__restrict__ O, float *__restrict__ LSE,
                 const void *__restrict__ mask, const unsigned char *__restrict__ tmap,
                 const int *__restrict__ key_lengths, int Nq, int Nk, int D, const __grid_constant__ AttnParams args) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    // q_full: Qi landed.  k_full / v_full: a stage's Kj / Vj landed (armed by the
    // producer with the bytes, completed by the TMA).  k_empty / v_empty: every
    // consumer thread is done reading a stage.
    __shared__ u64 q_full, k_full[KV_STAGES], v_full[KV_STAGES], k_empty[KV_STAGES], v_empty[KV_STAGES];
    unsigned char *smem = swizzle_base(smem_raw);
    elem_t *Qi = reinterpret_cast<elem_t *>(smem);  // [HD_ATOMS][BR][64]
    elem_t *Ks = Qi + BR * HDP;                      // [KV_STAGES][HD_ATOMS][BC][64]
    elem_t *Vs = Ks + KV_STAGES * BC * HDP;          // [KV_STAGES][HD_ATOMS][BC][64]

    const int tid = threadIdx.x, wg = tid / WG_THREADS, lane = tid % WARP_SIZE;
    if (tid == 0) {
        mbar_init(&q_full, 1);
        for (int s = 0; s < KV_STAGES; ++s) {
            mbar_init(&k_full[s], 1);
            mbar_init(&v_full[s], 1);
            mbar_init(&k_empty[s], FWD_THREADS);
            mbar_init(&v_empty[s], FWD_THREADS);
        }
        fence_barrier_init();
    }
    // The barriers are initialised before anyone arrives on or waits for them.
    __syncthreads();

    const int n_qt = (Nq + BR - 1) / BR;
    const FwdJob jb =
        fwd_job(0, n_qt, args.H, Nq, Nk, key_lengths, args.band_lo, args.band_hi, args.group_shift, tmap, args);
    const int hk = kv_head(jb.h, args.kv_group);  // the K/V head this job reads
    const int q0 = jb.q0, tc_begin = jb.tc_begin, tc_end = jb.tc_end;

    if (wg == FWD_WGS) {
        // Producer: Qi, then Kj and Vj of each key tile the job visits, each
        // into the stage its consumers have released.
        regs_lower<PRODUCER_REGS>();
        if (tid == FWD_THREADS && tc_begin < tc_end) {
            tma_prefetch_map(&args.q_map);
            tma_prefetch_map(&args.k_map);
            tma_prefetch_map(&args.v_map);
            mbar_arrive_expect_tx(&q_full, Q_BYTES);
            for (int a = 0; a < HD_ATOMS; ++a)
                tma_load(Qi + a * BR * SWZ_COLS, &args.q_map, &q_full, a * SWZ_COLS, q0, jb.h, jb.b);
            PipeState<KV_STAGES> ps;
            for (int tc = tc_begin; tc < tc_end; tc = job_next_tile(jb, tc), ps.advance()) {
                elem_t *Kst = Ks + ps.stage * BC * HDP, *Vst = Vs + ps.stage * BC * HDP;
                mbar_wait(&k_empty[ps.stage], ps.parity ^ 1u);  // (a fresh stage passes)
                mbar_arrive_expect_tx(&k_full[ps.stage], KV_BYTES);
                for (int a = 0; a < HD_ATOMS; ++a)
                    tma_load(Kst + a * BC * SWZ_COLS, &args.k_map, &k_full[ps.stage], a * SWZ_COLS, tc * BC, hk, jb.b);
                mbar_wait(&v_empty[ps.stage], ps.parity ^ 1u);
                mbar_arrive_expect_tx(&v_full[ps.stage], KV_BYTES);
                for (int a = 0; a < HD_ATOMS; ++a)
                    tma_load(Vst + a * BC * SWZ_COLS, &args.v_map, &v_full[ps.stage], a * SWZ_COLS, tc * BC, hk, jb.b);
            }
        }
        return;
    }

    // Consumers.
    regs_raise<CONSUMER_REGS>();
    const int warp_in_wg = (tid % WG_THREADS) / WARP_SIZE;
    const int g = lane >> 2, t = lane & 3;
    MaskParams mp = mask_params<BR, BC>(mask, nullptr, args, jb.kl, Nq, Nk, jb.b, jb.h);
    const char *mask_bh = mask_head_base(mp, jb.b, jb.h);
    const KeyRange kr = job_keys(jb, Nq, args);
    const int row_w = 64 * wg + 16 * warp_in_wg;  // first row of this warp in the tile
    // Descriptor bases: this warpgroup's 64 rows of Qi (K-major A operand).
    const u32 q_addr = smem_addr(Qi) + 64 * wg * SWZ_ROW_BYTES;
    const u32 k_addr0 = smem_addr(Ks), v_addr0 = smem_addr(Vs);
    constexpr u32 KV_STAGE_BYTES = BC * HDP * 2;

    // A stage of K or V, landed and with the keys outside kr zeroed.
    auto take = [&](u64 *full, elem_t *stage, const PipeState<KV_STAGES> &ps, int k0) {
        mbar_wait(&full[ps.stage], ps.parity);
        if (holds_unseen_keys(k0, kr)) {
            zero_unseen_keys(stage + ps.stage * BC * HDP, k0, kr, tid);
            fence_proxy_async();
            // Every consumer's zeros are visible to the tensor cores.
            named_sync(CONSUMERS_BARRIER, FWD_THREADS);
        }
    };

    float o_acc[O_REGS];
#pragma unroll
    for (int i = 0; i < O_REGS; ++i) o_acc[i] = 0.f;
    float m_i[2] = {NEG_INF, NEG_INF}, l_i[2] = {0.f, 0.f};  // running row max (log2 units), row sum

    // Software pipeline as in flash_fwd_sm90.cu: step j issues Sj = Qi Kj^T and
    // O += P(j-1) V(j-1) together, runs the softmax of Sj while the second
    // product is still on the tensor cores, then rescales Oi.
    float s[S_REGS];
    u32 p[BC / 16][4];
    PipeState<KV_STAGES> kp, vp;  // the next K stage to read, the next V stage
    int k_prev = 0;               // first key of the previous tile (the V to multiply next)
    if (tc_begin < tc_end) {
        mbar_wait(&q_full, 0);
        take(k_full, Ks, kp, tc_begin * BC);
        wgmma_fence();
        wgmma_over_head_dim<BR, BC>(s, q_addr, k_addr0 + kp.stage * KV_STAGE_BYTES);  // S0 = Qi K0^T
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_hold(s);
        mbar_arrive(&k_empty[kp.stage]);  // (K0 read)
        kp.advance();
        float alpha[2];  // (Oi is still 0: nothing to rescale)
        const bool need_mask = tile_needs_mask(mp, q0, BR, tc_begin * BC, BC, map_kind(job_kinds(jb), tc_begin));
        softmax_step(s, m_i, l_i, alpha, need_mask, args.scale_log2, mp, mask_bh, q0 + row_w + g,
                     tc_begin * BC + 2 * t);
        pack_frags(p, s);
        k_prev = tc_begin * BC;
    }
    for (int tc = job_next_tile(jb, tc_begin); tc < tc_end; tc = job_next_tile(jb, tc)) {
        const int k0 = tc * BC;
        take(k_full, Ks, kp, k0);
        take(v_full, Vs, vp, k_prev);
        wgmma_fence();
        wgmma_over_head_dim<BR, BC>(s, q_addr, k_addr0 + kp.stage * KV_STAGE_BYTES);  // Sj = Qi Kj^T
        wgmma_commit();
        wgmma_regs_a(o_acc, p, v_addr0 + vp.stage * KV_STAGE_BYTES);  // Oi += P(j-1) V(j-1)
        wgmma_commit();
#if FWD_OVERLAP
        wgmma_wait<1>();  // Sj is done; P(j-1) V(j-1) may still run
#else
        wgmma_wait<0>();  // both are done (P(j-1)'s registers free for the softmax)
        hold_frag(p);
#endif
        wgmma_hold(s);
        mbar_arrive(&k_empty[kp.stage]);  // (Kj read)
        kp.advance();
        float alpha[2];
        softmax_step(s, m_i, l_i, alpha, tile_needs_mask(mp, q0, BR, k0, BC, map_kind(job_kinds(jb), tc)),
                     args.scale_log2, mp, mask_bh, q0 + row_w + g, k0 + 2 * t);
        wgmma_wait<0>();  // P(j-1) V(j-1) is done: Oi and P(j-1) are free
        wgmma_hold(o_acc);
        hold_frag(p);
        mbar_arrive(&v_empty[vp.stage]);  // (V(j-1) read)
        vp.advance();
        rescale(o_acc, alpha);
        pack_frags(p, s);
        k_prev = k0;
    }
    if (tc_begin < tc_end) {  // the last Pij Vj
        take(v_full, Vs, vp, k_prev);
        wgmma_fence();
        wgmma_regs_a(o_acc, p, v_addr0 + vp.stage * KV_STAGE_BYTES);
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_hold(o_acc);
        hold_frag(p);
    }

    // Finish: li over the 4 lanes of a row, Oi /= li, Li = mi*ln2 + log(li).
    elem_t *Og = O + (i64)jb.b * args.o_sb + (i64)jb.h * args.o_sh;
#pragma unroll
    for (int r = 0; r < 2; ++r)
        store_out_row<HEAD_DIM / 8>(Og, args.o_sn, LSE, jb.b, jb.h, args.l_sb, args.l_sh, args.l_sn,
                                    q0 + row_w + g, r, Nq, D, t, m_i[r], l_i[r], args.vec,
                                    [&](int n, int e) { return o_acc[4 * n + 2 * r + e]; });
}
