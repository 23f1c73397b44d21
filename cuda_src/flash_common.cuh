// flash_common.cuh -- pieces shared by every pass (each reaches it through
// #include); pycudaflash.compiler adds the -D defines:
//   HEAD_DIM   padded head dimension of the variant (32, 64, 128, 256); the
//              actual D <= HEAD_DIM arrives at run time and the columns past D
//              are zero-filled in shared memory and never stored.
//   MASK_MODE  0: no dense mask, 1: bool mask (1 = attend), 2: float mask
//              (added to the scaled scores).
//   SCORE_MOD, MASK_MOD  1: a score modifier (score_mod, score_mod_slope) or
//              a mask modifier (mask_mod) is compiled in; their device code,
//              ModTensors and its helpers come first in the variant's source
//              (pycudaflash.mods.kernel_code), with MASK_MOD_READS_B and
//              MASK_MOD_READS_H: whether mask_mod reads b and h, and ModHead:
//              their values that depend on b and h alone (mod_head, once a job).
//
// Matrix products run on the tensor cores as split TF32 ("3xTF32"): each float
// x is split into a TF32 "big" part hi = rna(x) and a "small" part lo = x - hi
// (which the tensor core truncates to TF32), and a*b is accumulated in float32 as
// a_lo*b_hi + a_hi*b_lo + a_hi*b_hi (the a_lo*b_lo term, ~2^-22 relative, is
// dropped).  This keeps float32-level accuracy (about 1e-6 relative error) at
// tensor-core speed.
//
// mma.sync.m16n8k8 TF32 fragments, lane = 4*g + t (g = lane/4, t = lane%4):
//   A (16x8, row-major): a0 (g, k0)  a1 (g+8, k0)  a2 (g, k1)  a3 (g+8, k1)
//   B (8x8,  col-major): b0 (k0, g)  b1 (k1, g)
//   C (16x8):            c0 (g, 2t)  c1 (g, 2t+1)  c2 (g+8, 2t)  c3 (g+8, 2t+1)
// where (k0, k1) = (t, t+4).  Because the k index is summed over, any
// permutation of it applied to A and B alike gives the same product; we use
// the "interleaved" order (k0, k1) = (2t, 2t+1) where it avoids shared-memory
// bank conflicts and where A comes from a C fragment (P and dS).

#pragma once

#ifndef HEAD_DIM
#error "HEAD_DIM must be defined"
#endif
#ifndef MASK_MODE
#error "MASK_MODE must be defined (pycudaflash.compiler.defines)"
#endif

static_assert(HEAD_DIM % 32 == 0 && HEAD_DIM >= 32 && HEAD_DIM <= 256,
              "HEAD_DIM is a multiple of 32 in [32, 256]");
static_assert(MASK_MODE >= 0 && MASK_MODE <= 2, "MASK_MODE is 0, 1 or 2");
#if !defined(SCORE_MOD) || !defined(MASK_MOD)
#error "SCORE_MOD and MASK_MOD must be defined (pycudaflash.compiler.defines)"
#endif
#define MODS (SCORE_MOD || MASK_MOD)  // a modifier is compiled in
// The kernels read a block map (see flash_tile_map): of the bool mask, or
// without one, of the mask modifier.
#define TILE_MAPS (MASK_MODE == 1 || MASK_MOD)

#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f
#define NEG_INF (-__int_as_float(0x7f800000))

typedef unsigned int u32;
typedef long long i64;

#define WARP_SIZE 32
#define TF32_MASK 0xffffe000u      // sign, exponent and the 10 mantissa bits TF32 keeps
#define TF32_HALF_ULP 0x00001000u  // half a TF32 ulp, in float bit units
// Shared-memory row padding (floats): row strides = 4 (mod 32) words keep
// every fragment access pattern used here free of bank conflicts.
#ifndef SMEM_PAD
#error "SMEM_PAD must be defined (pycudaflash.compiler.LAYOUT)"
#endif
#define LD_HEAD (HEAD_DIM + SMEM_PAD)

#include "flash_params.cuh"

// How a kernel is launched, stated once, next to the kernel: threads a
// block, rows or keys a block (the unit its grid counts), and bytes of
// dynamic shared memory (from the kernel's own shared-memory layout).  The
// launch code reads these constants from the cubin
// (pycudaflash.compiler.kernel_shape).
#define LAUNCH_SHAPE(kernel, threads, tile, smem_bytes)        \
    extern "C" __constant__ int kernel##_threads = (threads);  \
    extern "C" __constant__ int kernel##_tile = (tile);        \
    extern "C" __constant__ int kernel##_smem_bytes = (int)(smem_bytes)

// The tiles of a kernel that reads a block map (rows x keys, see
// flash_tile_map): the launch code builds the map with them
// (pycudaflash.compiler.map_tile).
#define TILE_MAP(kernel, rows, keys)                       \
    extern "C" __constant__ int kernel##_map_rows = (rows); \
    extern "C" __constant__ int kernel##_map_keys = (keys)

// Threads a block of the grid-stride kernels (mask conversion, group sums).
#define GRID_STRIDE_THREADS 256

// ---------------------------------------------------------------- 3xTF32 mma

__device__ __forceinline__ void split_tf32(float x, u32 &hi, u32 &lo) {
    // hi = x rounded to TF32 (nearest, ties away: add half an ulp to the bit
    // pattern, clear the 13 low bits); lo = x - hi exactly, passed as is (the
    // tensor core reads its top 10 mantissa bits).  Inputs are finite.
    hi = (__float_as_uint(x) + TF32_HALF_ULP) & TF32_MASK;
    lo = __float_as_uint(x - __uint_as_float(hi));
}

__device__ __forceinline__ void mma_tf32(float (&c)[4], const u32 (&a)[4], const u32 (&b)[2]) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// c += a*b with the small terms first, the big product last.
__device__ __forceinline__ void mma_3xtf32(float (&c)[4], const u32 (&ahi)[4], const u32 (&alo)[4],
                                           const u32 (&bhi)[2], const u32 (&blo)[2]) {
    mma_tf32(c, alo, bhi);
    mma_tf32(c, ahi, blo);
    mma_tf32(c, ahi, bhi);
}

// C fragments (MT x NT tiles of 16 x 8) set to zero.
template <int MT, int NT>
__device__ __forceinline__ void zero_frags(float (&c)[MT][NT][4]) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) c[mt][n][e] = 0.f;
}

// Warp-level C[16*MT x 8*NT] += A[16*MT x K] * B[K x 8*NT] with A and B read
// through accessors A(m, k), B(k, n) (shared memory), k over [0, 8*ksteps).
// INTERLEAVED picks the k order inside each 8-wide step (see the top).
// Column tiles with 8*nt >= n_limit are skipped (past the actual head dim).
template <int MT, int NT, bool INTERLEAVED, typename LoadA, typename LoadB>
__device__ __forceinline__ void warp_mma(float (&acc)[MT][NT][4], const LoadA &A, const LoadB &B,
                                         int ksteps, int n_limit, int lane) {
    const int g = lane >> 2, t = lane & 3;
    const int k0 = INTERLEAVED ? 2 * t : t;
    const int k1 = INTERLEAVED ? 2 * t + 1 : t + 4;
#pragma unroll 2
    for (int ks = 0; ks < ksteps; ++ks) {
        const int kb = 8 * ks;
        u32 ahi[MT][4], alo[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            split_tf32(A(16 * mt + g, kb + k0), ahi[mt][0], alo[mt][0]);
            split_tf32(A(16 * mt + g + 8, kb + k0), ahi[mt][1], alo[mt][1]);
            split_tf32(A(16 * mt + g, kb + k1), ahi[mt][2], alo[mt][2]);
            split_tf32(A(16 * mt + g + 8, kb + k1), ahi[mt][3], alo[mt][3]);
        }
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            if (8 * nt < n_limit) {
                u32 bhi[2], blo[2];
                split_tf32(B(kb + k0, 8 * nt + g), bhi[0], blo[0]);
                split_tf32(B(kb + k1, 8 * nt + g), bhi[1], blo[1]);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) mma_3xtf32(acc[mt][nt], ahi[mt], alo[mt], bhi, blo);
            }
        }
    }
}

// Warp-level C[16 x 8*NT] += P[16 x 8*KT] * B[8*KT x 8*NT] where P is held in
// registers in the C-fragment layout of a previous product (p[kt] covers
// columns 8kt..8kt+7).  The C layout is the A layout under the interleaved k
// order, so no data moves between lanes.
template <int KT, int NT, typename LoadB>
__device__ __forceinline__ void warp_mma_rega(float (&acc)[NT][4], const float (&p)[KT][4],
                                              const LoadB &B, int lane) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int kt = 0; kt < KT; ++kt) {
        u32 ahi[4], alo[4];
        split_tf32(p[kt][0], ahi[0], alo[0]);  // (g,   2t)
        split_tf32(p[kt][2], ahi[1], alo[1]);  // (g+8, 2t)
        split_tf32(p[kt][1], ahi[2], alo[2]);  // (g,   2t+1)
        split_tf32(p[kt][3], ahi[3], alo[3]);  // (g+8, 2t+1)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            u32 bhi[2], blo[2];
            split_tf32(B(8 * kt + 2 * t, 8 * nt + g), bhi[0], blo[0]);
            split_tf32(B(8 * kt + 2 * t + 1, 8 * nt + g), bhi[1], blo[1]);
            mma_3xtf32(acc[nt], ahi, alo, bhi, blo);
        }
    }
}

// acc[NT] += P * B as warp_mma_rega, but through fresh accumulators of CHUNK
// tiles that are then added in float32.  The tensor cores truncate when they
// add into an accumulator; summing a long loop (all key tiles) directly into
// one would let that bias grow with the sequence length, while a fresh
// accumulator per call only sees the 8*KT terms of one tile.
template <int KT, int NT, int CHUNK, typename LoadB>
__device__ __forceinline__ void warp_mma_rega_add(float (&acc)[NT][4], const float (&p)[KT][4],
                                                  const LoadB &B, int lane) {
    static_assert(NT % CHUNK == 0, "whole chunks");
#pragma unroll
    for (int c0 = 0; c0 < NT; c0 += CHUNK) {
        float part[CHUNK][4];
#pragma unroll
        for (int n = 0; n < CHUNK; ++n) part[n][0] = part[n][1] = part[n][2] = part[n][3] = 0.f;
        warp_mma_rega<KT, CHUNK>(part, p, [&](int k, int n) { return B(k, 8 * c0 + n); }, lane);
#pragma unroll
        for (int n = 0; n < CHUNK; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[c0 + n][e] += part[n][e];
    }
}

// ------------------------------------------------------------ async copies

__device__ __forceinline__ void cp_async16(float *dst, const float *src, bool valid) {
    const u32 d = (u32)__cvta_generic_to_shared(dst);
    const int n = valid ? 16 : 0;  // 0: fill the 16 bytes with zeros
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(n));
}

__device__ __forceinline__ void cp_async4(float *dst, const float *src, bool valid) {
    const u32 d = (u32)__cvta_generic_to_shared(dst);
    const int n = valid ? 4 : 0;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(d), "l"(src), "r"(n));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// Seen-key bits (written beside a block map, see map_plane): bit j % 32 of
// word j / 32 is set where some query row may see key j under the dense mask,
// the mask modifier and the band; nullptr: every key.
__device__ __forceinline__ bool bit_set(const u32 *bits, int j) {
    return !bits || ((__ldg(bits + (j >> 5)) >> (j & 31)) & 1u);
}

// Whether every j in [lo, hi) has its bit (true for an empty range or no bits).
__device__ __forceinline__ bool bits_all_set(const u32 *bits, int lo, int hi) {
    if (!bits || hi <= lo) return true;
    const int w_first = lo >> 5, w_last = (hi - 1) >> 5;
    for (int w = w_first; w <= w_last; ++w) {
        u32 need = ~0u;
        if (w == w_first) need &= ~0u << (lo & 31);
        if (w == w_last) need &= ~0u >> (31 - ((hi - 1) & 31));
        if ((__ldg(bits + w) & need) != need) return false;
    }
    return true;
}

// bits_all_set for a range inside [row0, row0 + ROWS), unrolled over its at
// most ROWS / 32 + 1 words (fewer registers where a loop would keep its own).
template <int ROWS>
__device__ __forceinline__ bool tile_bits_all_set(const u32 *bits, int row0, int lo, int hi) {
    if (!bits || hi <= lo) return true;
    u32 missing = 0u;
#pragma unroll
    for (int w = 0; w <= (ROWS + 31) / 32; ++w) {
        const int j0 = (row0 & ~31) + 32 * w;  // keys j0 .. j0 + 31 of word j0 / 32
        const int a = max(lo - j0, 0), b = min(hi - j0, 32);
        if (a < b) {
            const u32 need = (b == 32 ? ~0u : (1u << b) - 1u) & (~0u << a);
            missing |= need & ~__ldg(bits + (j0 >> 5));
        }
    }
    return missing == 0u;
}

// load_tile's copies, their loop unrolled UNROLL times; BITS: also test each
// row's bit in row_bits (a tile holding keys that no row may see, rare: a
// rolled loop, which keeps few registers).  Kernels with a block map unroll
// the plain copies less: they hold the seen-key bits' pointer through the
// loop over Kj besides.
constexpr int COPY_UNROLL = TILE_MAPS ? 2 : 4;
template <int ROWS, int NTHREADS, bool BITS, int UNROLL>
__device__ __forceinline__ void copy_rows(float *smem, const float *gmem, i64 stride, int row0, int nrows, int ncols,
                                          bool vec, int tid, int row_lo, const u32 *row_bits) {
    if (vec) {
        constexpr int CHUNKS = HEAD_DIM / 4;
#pragma unroll(BITS ? 1 : UNROLL)
        for (int c = tid; c < ROWS * CHUNKS; c += NTHREADS) {
            const int r = c / CHUNKS, col = 4 * (c % CHUNKS);
            const bool ok =
                (row0 + r >= row_lo) && (row0 + r < nrows) && (col < ncols) && (!BITS || bit_set(row_bits, row0 + r));
            const float *src = ok ? gmem + (i64)(row0 + r) * stride + col : gmem;
            cp_async16(smem + r * LD_HEAD + col, src, ok);
        }
    } else {
#pragma unroll(BITS ? 1 : UNROLL)
        for (int c = tid; c < ROWS * HEAD_DIM; c += NTHREADS) {
            const int r = c / HEAD_DIM, col = c % HEAD_DIM;
            const bool ok =
                (row0 + r >= row_lo) && (row0 + r < nrows) && (col < ncols) && (!BITS || bit_set(row_bits, row0 + r));
            const float *src = ok ? gmem + (i64)(row0 + r) * stride + col : gmem;
            cp_async4(smem + r * LD_HEAD + col, src, ok);
        }
    }
}

// Copy rows [row0, row0 + ROWS) x columns [0, HEAD_DIM) of a row-major
// global matrix (row stride `stride` floats, rows [row_lo, nrows) whose bit
// is set in row_bits (bit_set) and `ncols` = D columns valid) into
// smem[ROWS][LD_HEAD]; everything outside is zero-filled.  vec: 16-byte
// copies (D % 4 == 0, 16-byte aligned base and stride).  (WHOLE as the
// 16-bit load_tile's; a tile with row bits always takes a copy loop of its
// own here, and LEAN_BITS, in a kernel with a block map, rolls the plain
// copy loop as well.)
template <int ROWS, int NTHREADS, bool SWZ = false, bool WHOLE = false, bool LEAN_BITS = false>
__device__ __forceinline__ void load_tile(float *smem, const float *gmem, i64 stride, int row0, int nrows, int ncols,
                                          bool vec, int tid, int row_lo = 0, const u32 *row_bits = nullptr) {
    static_assert(!SWZ, "float32 tiles are row-major");
    constexpr int PLAIN_UNROLL = (LEAN_BITS && TILE_MAPS) ? 1 : COPY_UNROLL;
    if (tile_bits_all_set<ROWS>(row_bits, row0, max(row0, row_lo), min(row0 + ROWS, nrows)))
        copy_rows<ROWS, NTHREADS, false, PLAIN_UNROLL>(smem, gmem, stride, row0, nrows, ncols, vec, tid, row_lo,
                                                      nullptr);
    else
        copy_rows<ROWS, NTHREADS, true, 1>(smem, gmem, stride, row0, nrows, ncols, vec, tid, row_lo, row_bits);
}

// ------------------------------------------------------------------ masks

// Everything a kernel needs to decide whether row i may attend key j.
struct MaskParams {
    const void *mask;        // dense mask or nullptr (MASK_MODE 0)
    i64 m_sb, m_sh, m_sq, m_sk;  // its element strides (0 on broadcast dims)
    int band_lo, band_hi;    // row i sees keys i + band_lo <= j <= i + band_hi
    int kl;                  // keys j >= kl are padding (key length)
    int nq;                  // rows i >= nq do not exist
#if TILE_MAPS
    const unsigned char *tmap;  // the block map's plane at (b, h), nullptr: none (see map_plane)
    int tm_nk;                  // key tiles a row of it
    const u32 *seen;            // the plane's seen-key bits (nullptr: none)
#endif
#if MODS
    int b, h;                // batch element and head (of the modifiers)
    float scale;             // softmax scale: the score modifier's score is scale * q.k (+ bias)
    const ModTensors *mods;  // the modifiers' tensors (in the parameter struct)
    ModHead hv;              // their values at (b, h) (mask_head)
#endif
};

// The batch element b and head h the modifiers see, and their values there.
__device__ __forceinline__ void mask_head(MaskParams &mp, int b, int h) {
#if MODS
    mp.b = b, mp.h = h;
    mp.hv = mod_head(b, h, *mp.mods);
#else
    (void)mp; (void)b; (void)h;
#endif
}

// A block map (written by flash_tile_map or flash_mod_tile_map) for a
// kernel's tiles of br rows x bc keys has a plane for each (b, h) of the
// bool mask and the mask modifier together (one for a dimension the mask
// broadcasts over and the modifier does not read).  A plane holds the kinds
// of its `tiles` = ceil(Nq / br) x ceil(Nk / bc) tiles, one byte each,
// row-major, then, from the next multiple of 4 bytes, its seen-key bits
// (bit_set): ceil(Nk / 32) words, the keys that some row may see under the
// mask, the modifier and the band.  (pycudaflash.cuda_backend sizes maps
// the same way.)
__device__ __forceinline__ i64 map_bits_offset(i64 tiles) { return (tiles + 3) / 4 * 4; }
__device__ __forceinline__ i64 map_plane_bytes(i64 tiles, int Nk) {
    return map_bits_offset(tiles) + 4 * (i64)((Nk + 31) / 32);
}

// The plane at (batch b, head h) of a block map (tmap; nullptr: none) for a
// kernel's tiles of BR_ rows x BC_ keys.
template <int BR_, int BC_>
__device__ __forceinline__ const unsigned char *map_plane(const unsigned char *tmap, const AttnParams &args, int Nq,
                                                          int Nk, int b, int h) {
#if TILE_MAPS
    const i64 plane = map_plane_bytes((i64)((Nq + BR_ - 1) / BR_) * ((Nk + BC_ - 1) / BC_), Nk);
    bool per_b = false, per_h = false;
#if MASK_MODE == 1
    per_b = args.m_sb != 0;
    per_h = args.m_sh != 0;
#endif
#if MASK_MOD
    per_b |= (bool)MASK_MOD_READS_B;
    per_h |= (bool)MASK_MOD_READS_H;
#endif
    return tmap ? tmap + ((per_b ? (i64)b * (per_h ? args.H : 1) : 0) + (per_h ? h : 0)) * plane : nullptr;
#else
    (void)tmap; (void)args; (void)Nq; (void)Nk; (void)b; (void)h;
    return nullptr;
#endif
}

// The seen-key bits of a plane of a kernel's block map (nullptr: none).
template <int BR_, int BC_>
__device__ __forceinline__ const u32 *plane_seen(const unsigned char *plane, int Nq, int Nk) {
    return plane ? reinterpret_cast<const u32 *>(
                       plane + map_bits_offset((i64)((Nq + BR_ - 1) / BR_) * ((Nk + BC_ - 1) / BC_)))
                 : nullptr;
}

// The masking rules of a call for one (batch b, head h): band, key length kl
// (see key_length), dense mask, the block map's plane for the kernel's tiles
// of BR_ rows x BC_ keys (map_plane) and its seen-key bits, modifiers.
template <int BR_, int BC_>
__device__ __forceinline__ MaskParams mask_params(const void *mask, const unsigned char *tmap, const AttnParams &args,
                                                  int kl, int nq, int Nk, int b, int h) {
    MaskParams mp;
    mp.mask = mask;
#if TILE_MAPS
    mp.tmap = map_plane<BR_, BC_>(tmap, args, nq, Nk, b, h);
    mp.tm_nk = (Nk + BC_ - 1) / BC_;
    mp.seen = plane_seen<BR_, BC_>(mp.tmap, nq, Nk);
#else
    (void)tmap;
#endif
    mp.m_sb = args.m_sb; mp.m_sh = args.m_sh; mp.m_sq = args.m_sq; mp.m_sk = args.m_sk;
    mp.band_lo = args.band_lo; mp.band_hi = args.band_hi;
    mp.kl = kl;
    mp.nq = nq;
#if MODS
    mp.scale = args.scale;
    mp.mods = &args.mods;
#endif
    mask_head(mp, b, h);
    return mp;
}

// Keys of batch element b: key_lengths[b] clamped to [0, Nk], or Nk without key lengths.
__device__ __forceinline__ int key_length(const int *key_lengths, int b, int Nk) {
    return key_lengths ? min(max(key_lengths[b], 0), Nk) : Nk;
}

// Tiles [begin, end) along one axis of the score matrix.
struct TileRange {
    int begin, end;
};

// Keys [lo, hi) that any of the query rows [q0, q0 + rows) may see under
// the band (band_lo, band_hi), key length kl and nq rows (hi <= lo: none),
// and of those the ones whose bit is set in the seen-key bits of the block
// map (seen; nullptr: all of them).
struct KeyRange {
    int lo, hi;
#if TILE_MAPS
    const u32 *seen;
#endif
};
__device__ __forceinline__ KeyRange seen_keys(int q0, int rows, int nq, int kl, int band_lo, int band_hi,
                                              const u32 *seen = nullptr) {
    const int q_last = min(q0 + rows, nq) - 1;
#if TILE_MAPS
    return {max(0, q0 + band_lo), min(kl, q_last + band_hi + 1), seen};
#else
    (void)seen;
    return {max(0, q0 + band_lo), min(kl, q_last + band_hi + 1)};
#endif
}

// The seen-key bits of a key range and of masking rules (nullptr: none).
__device__ __forceinline__ const u32 *range_bits(const KeyRange &kr) {
#if TILE_MAPS
    return kr.seen;
#else
    (void)kr;
    return nullptr;
#endif
}
__device__ __forceinline__ const u32 *mask_seen(const MaskParams &mp) {
#if TILE_MAPS
    return mp.seen;
#else
    (void)mp;
    return nullptr;
#endif
}

// Whether key j is one of the keys kr.
__device__ __forceinline__ bool key_in(const KeyRange &kr, int j) {
    return j >= kr.lo && j < kr.hi && bit_set(range_bits(kr), j);
}

// Key tiles (of bc keys) that any of the query rows [q0, q0 + rows) may see.
// The K and V loads zero-fill the keys of those tiles outside seen_keys, so
// that a NaN or Inf stored in a key no row may see (under the band, or the
// dense mask and mask modifier: the seen-key bits) never meets a zero
// probability in a product.
__device__ __forceinline__ TileRange key_tiles(int q0, int rows, int nq, int kl, int band_lo, int band_hi, int bc) {
    const KeyRange kr = seen_keys(q0, rows, nq, kl, band_lo, band_hi);
    const int begin = kr.lo / bc;
    return {begin, (kr.hi > kr.lo) ? (kr.hi + bc - 1) / bc : begin};
}

// Query tiles (of br rows) with a row that may see any of the keys [k0, k0 + cols).
__device__ __forceinline__ TileRange query_tiles(int k0, int cols, int nq, int kl, int band_lo, int band_hi, int br) {
    const int k_last = min(k0 + cols, kl) - 1;
    const int i_begin = max(0, k0 - band_hi);
    const int i_end = (k_last >= k0) ? min(nq, k_last - band_lo + 1) : i_begin;
    const int begin = i_begin / br;
    return {begin, (i_end > i_begin) ? (i_end + br - 1) / br : begin};
}

// ------------------------------------------------------------ block map
// What the dense mask leaves of a tile of the score matrix.
#define TILE_EMPTY 0    // no element attended: the tile is skipped
#define TILE_PARTIAL 1  // some: the mask is read per element
#define TILE_FULL 2     // all (or no dense mask): no per-element test

// The kind under the dense mask and the mask modifier of map entry p[idx]:
// from the block map (p; PARTIAL where there is none, and at most PARTIAL
// with a float mask), FULL without either.  (The band, key lengths and
// modifiers are not in the map: tile_needs_mask adds them.)
__device__ __forceinline__ int map_kind(const unsigned char *p, i64 idx) {
#if TILE_MAPS
    const int kind = p ? p[idx] : TILE_PARTIAL;
    return MASK_MODE == 2 ? min(kind, TILE_PARTIAL) : kind;
#else
    (void)p; (void)idx;
    return MASK_MODE == 2 ? TILE_PARTIAL : TILE_FULL;
#endif
}

// The first tile t' >= t before end whose map entry p[t' * stride] is not
// EMPTY (without a map, t itself): the tiles a loop visits.
__device__ __forceinline__ int next_tile(const unsigned char *p, int stride, int t, int end) {
#if TILE_MAPS
    if (p)
        while (t < end && p[(i64)t * stride] == TILE_EMPTY) ++t;
#else
    (void)p; (void)stride; (void)end;
#endif
    return t;
}

// The block map's entries of query tile tr (key tiles 1 apart) and of key
// tile tc (query tiles map_stride apart); nullptr without a map.
__device__ __forceinline__ const unsigned char *map_row(const MaskParams &mp, int tr) {
#if TILE_MAPS
    return mp.tmap ? mp.tmap + (i64)tr * mp.tm_nk : nullptr;
#else
    (void)mp; (void)tr;
    return nullptr;
#endif
}
__device__ __forceinline__ const unsigned char *map_col(const MaskParams &mp, int tc) {
#if TILE_MAPS
    return mp.tmap ? mp.tmap + tc : nullptr;
#else
    (void)mp; (void)tc;
    return nullptr;
#endif
}
__device__ __forceinline__ int map_stride(const MaskParams &mp) {
#if TILE_MAPS
    return mp.tm_nk;
#else
    (void)mp;
    return 0;
#endif
}

// Does the band, key length or row range hide an element of the tile
// [i0, i0 + rows) x [j0, j0 + cols)?
__device__ __forceinline__ bool band_needs_mask(const MaskParams &mp, int i0, int rows, int j0, int cols) {
    return j0 + cols > mp.kl || i0 + rows > mp.nq || j0 < i0 + rows - 1 + mp.band_lo ||
           j0 + cols - 1 > i0 + mp.band_hi;
}

// Does anything hide an element of the tile: band_needs_mask, or a dense
// mask or mask modifier that leaves the tile less than FULL (`kind`, from
// map_kind; a mask modifier without its map is PARTIAL everywhere)?  A tile
// that needs none of the tests still takes the score modifier (tile_score).
__device__ __forceinline__ bool tile_needs_mask(const MaskParams &mp, int i0, int rows, int j0, int cols, int kind) {
    return band_needs_mask(mp, i0, rows, j0, cols) || kind != TILE_FULL;
}

// A block map for tiles of br rows x bc keys (layout: map_plane), one block
// per tile of the map (grid: its tiles, its heads, its batch elements): the
// warps take the tile's rows in turn and their lanes the keys, each asking
// keep(i, j) of its elements; a tile past Nq or Nk counts the elements that
// exist.  The keys kept for a row of the band (band_lo <= j - i <= band_hi)
// are added to the plane's seen-key bits (cleared first: flash_clear_seen).
template <typename Keep>
__device__ __forceinline__ void tile_map_votes(unsigned char *tmap, int Nq, int Nk, int br, int bc, int band_lo,
                                               int band_hi, Keep keep) {
    constexpr int WARPS = GRID_STRIDE_THREADS / WARP_SIZE;
    const int nk = (Nk + bc - 1) / bc;
    const int r = blockIdx.x / nk, c = blockIdx.x - r * nk;
    const int i0 = r * br, j0 = c * bc;
    const int rows = min(br, Nq - i0), cols = min(bc, Nk - j0);
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    unsigned char *plane = tmap + ((i64)blockIdx.z * gridDim.y + blockIdx.y) * map_plane_bytes(gridDim.x, Nk);
    u32 *seen = reinterpret_cast<u32 *>(plane + map_bits_offset(gridDim.x));
    bool any = false, all = true;
    for (int j_w = 0; j_w < cols; j_w += WARP_SIZE) {  // (the same in every lane: the vote below)
        const int j = j0 + j_w + lane;
        bool seen_j = false;
        if (j_w + lane < cols)
            for (int i = i0 + warp; i < i0 + rows; i += WARPS) {
                const bool k = keep(i, j);
                any |= k;
                all &= k;
                seen_j |= k && j - i >= band_lo && j - i <= band_hi;
            }
        // This warp's seen keys of j0 + j_w .. + 31, into the one or two words they fall in.
        const u32 votes = __ballot_sync(0xffffffffu, seen_j);
        const int first = j0 + j_w, shift = first & 31;
        if (lane == 0 && votes) {
            atomicOr(seen + (first >> 5), votes << shift);
            if (shift && (votes >> (32 - shift))) atomicOr(seen + (first >> 5) + 1, votes >> (32 - shift));
        }
    }
    // (the block's votes: every thread's any and all are in)
    any = __syncthreads_or(any);
    all = __syncthreads_and(all);
    if (threadIdx.x == 0) plane[blockIdx.x] = !any ? TILE_EMPTY : (all ? TILE_FULL : TILE_PARTIAL);
}

// The seen-key bits of every plane of a block map of `tiles` tiles a plane
// cleared (grid: 1, its heads, its batch elements), before its build.
LAUNCH_SHAPE(flash_clear_seen, GRID_STRIDE_THREADS, 1, 0);
extern "C" __global__ void __launch_bounds__(GRID_STRIDE_THREADS)
flash_clear_seen(unsigned char *__restrict__ tmap, int Nk, int tiles, const __grid_constant__ AttnParams args) {
    (void)args;
    unsigned char *plane = tmap + ((i64)blockIdx.z * gridDim.y + blockIdx.y) * map_plane_bytes(tiles, Nk);
    u32 *seen = reinterpret_cast<u32 *>(plane + map_bits_offset(tiles));
    for (int w = threadIdx.x; w < (Nk + 31) / 32; w += GRID_STRIDE_THREADS) seen[w] = 0u;
}

// The block map of a bool mask, and of the mask modifier with it (the
// plane's batch element and head: blockIdx.z, .y; 0 where neither varies).
LAUNCH_SHAPE(flash_tile_map, GRID_STRIDE_THREADS, 1, 0);
extern "C" __global__ void __launch_bounds__(GRID_STRIDE_THREADS)
flash_tile_map(const unsigned char *__restrict__ mask, unsigned char *__restrict__ tmap, int Nq, int Nk, int br,
               int bc, const __grid_constant__ AttnParams args) {
    const unsigned char *m = mask + (i64)blockIdx.z * args.m_sb + (i64)blockIdx.y * args.m_sh;
#if MASK_MOD
    const ModHead hv = mod_head(blockIdx.z, blockIdx.y, args.mods);
#endif
    tile_map_votes(tmap, Nq, Nk, br, bc, args.band_lo, args.band_hi, [&](int i, int j) {
#if MASK_MOD
        return m[(i64)i * args.m_sq + (i64)j * args.m_sk] != 0 &&
               mask_mod(0.f, blockIdx.z, blockIdx.y, i, j, args.mods, hv);
#else
        return m[(i64)i * args.m_sq + (i64)j * args.m_sk] != 0;
#endif
    });
}

#if MASK_MOD
// The block map of the mask modifier without a bool mask (batch element and
// head: blockIdx.z, .y; 0 for a position it does not read).
LAUNCH_SHAPE(flash_mod_tile_map, GRID_STRIDE_THREADS, 1, 0);
extern "C" __global__ void __launch_bounds__(GRID_STRIDE_THREADS)
flash_mod_tile_map(unsigned char *__restrict__ tmap, int Nq, int Nk, int br, int bc,
                   const __grid_constant__ AttnParams args) {
    const int b = blockIdx.z, h = blockIdx.y;
    const ModHead hv = mod_head(b, h, args.mods);
    tile_map_votes(tmap, Nq, Nk, br, bc, args.band_lo, args.band_hi,
                   [&](int i, int j) { return (bool)mask_mod(0.f, b, h, i, j, args.mods, hv); });
}
#endif

#if SCORE_MOD
// The score of element (i, j) before the score modifier, in natural units:
// scale * s (+ the float mask's bias).
__device__ __forceinline__ float unmodified_score(float s, const MaskParams &mp, const char *mask_base, int i,
                                                  int j) {
    float x = s * mp.scale;
#if MASK_MODE == 2
    x += *((const float *)mask_base + (i64)i * mp.m_sq + (i64)j * mp.m_sk);
#endif
    return x;
}
#endif

// Scaled score of element (i, j) in log2 units, or -inf where it is masked.
// `mask_base` already points at batch b, head h of the dense mask.
__device__ __forceinline__ float masked_score(float s, float scale_log2, const MaskParams &mp,
                                              const char *mask_base, int i, int j) {
    const bool in_band = (j < mp.kl) && (i < mp.nq) && (j >= i + mp.band_lo) && (j <= i + mp.band_hi);
    if (!in_band) return NEG_INF;
#if MASK_MOD
    // The mask modifier excludes like the other conditions.
    if (!mask_mod(0.f, mp.b, mp.h, i, j, *mp.mods, mp.hv)) return NEG_INF;
#endif
    float x = s * scale_log2;
#if MASK_MODE == 1
    const unsigned char keep = *((const unsigned char *)mask_base + (i64)i * mp.m_sq + (i64)j * mp.m_sk);
    if (!keep) return NEG_INF;
#elif MASK_MODE == 2 && !SCORE_MOD
    const float bias = *((const float *)mask_base + (i64)i * mp.m_sq + (i64)j * mp.m_sk);
    x = fmaf(bias, LOG2E, x);
#endif
#if SCORE_MOD
    // The score modifier replaces the (biased) score, in natural units.
    x = score_mod(unmodified_score(s, mp, mask_base, i, j), mp.b, mp.h, i, j, *mp.mods, mp.hv) * LOG2E;
#endif
    return x;
}

// Scaled score of element (i, j) in log2 units on a tile of the kind
// tile_needs_mask says: masked_score where it needs the tests, else
// s * scale_log2, through the score modifier if there is one.
__device__ __forceinline__ float tile_score(float s, bool need_mask, float scale_log2, const MaskParams &mp,
                                            const char *mask_base, int i, int j) {
    if (need_mask) return masked_score(s, scale_log2, mp, mask_base, i, j);
#if SCORE_MOD
    return score_mod(unmodified_score(s, mp, mask_base, i, j), mp.b, mp.h, i, j, *mp.mods, mp.hv) * LOG2E;
#else
    (void)mp; (void)mask_base; (void)i; (void)j;
    return s * scale_log2;
#endif
}

#if SCORE_MOD
// d(score_mod)/d(score) of element (i, j) at its unmodified score.
__device__ __forceinline__ float score_slope(float s, const MaskParams &mp, const char *mask_base, int i, int j) {
    return score_mod_slope(unmodified_score(s, mp, mask_base, i, j), mp.b, mp.h, i, j, *mp.mods, mp.hv);
}

// dS of an element through the score modifier: dS times its slope (nothing
// flows where dS is 0, whatever the slope there).
__device__ __forceinline__ float through_score_mod(float ds, float slope) { return (ds == 0.f) ? 0.f : ds * slope; }
#endif

// The backward's hook: dS of element (i, j) (score s = q.k) through the
// score modifier; dS itself without one.
#if SCORE_MOD
#define DS_THROUGH_SCORE_MOD(ds, s, mp, mask_base, i, j) \
    through_score_mod((ds), score_slope((s), (mp), (mask_base), (i), (j)))
#else
#define DS_THROUGH_SCORE_MOD(ds, s, mp, mask_base, i, j) (ds)
#endif

// Base of the dense mask at (b, h), as bytes; nullptr without a dense mask.
__device__ __forceinline__ const char *mask_head_base(const MaskParams &mp, int b, int h) {
#if MASK_MODE == 1
    return (const char *)mp.mask + (i64)b * mp.m_sb + (i64)h * mp.m_sh;
#elif MASK_MODE == 2
    return (const char *)((const float *)mp.mask + (i64)b * mp.m_sb + (i64)h * mp.m_sh);
#else
    return nullptr;
#endif
}

// ------------------------------------------------------ dK/dV blocks

// The work of a dK/dV block.  Grid (H, B, key tiles), the key tile slowest,
// so that all heads' first (under a causal band, longest) key tiles are
// scheduled before any later one: keys k0..k0+KEYS-1 of (batch b, head h),
// their masking rules (mp; mask_bh, the dense mask at (b, h)), the (b, h)
// planes of Q and dO, the offset of the block's rows in the (B, H, Nq)
// workspace arrays (Dvec, L2vec, dQacc) and the query tiles (of ROWS rows)
// with a row that sees any of its keys, from the first one the block map
// leaves (next_tile walks on from there).
template <typename T>
struct KeyTile {
    int h, b, H, k0;
    MaskParams mp;
    const char *mask_bh;
    const T *Qg, *dOg;
    i64 row_base;
    TileRange qt;
};

template <int KEYS, int ROWS, typename T>
__device__ __forceinline__ KeyTile<T> key_tile(const T *Q, const T *dO, const void *mask, const unsigned char *tmap,
                                               const int *key_lengths, int Nq, int Nk, const AttnParams &args) {
    KeyTile<T> blk;
    blk.h = blockIdx.x, blk.b = blockIdx.y, blk.H = gridDim.x;
    blk.k0 = blockIdx.z * KEYS;
    blk.mp = mask_params<ROWS, KEYS>(mask, tmap, args, key_length(key_lengths, blk.b, Nk), Nq, Nk, blk.b, blk.h);
    blk.mask_bh = mask_head_base(blk.mp, blk.b, blk.h);
    blk.Qg = Q + (i64)blk.b * args.q_sb + (i64)blk.h * args.q_sh;
    blk.dOg = dO + (i64)blk.b * args.do_sb + (i64)blk.h * args.do_sh;
    blk.row_base = ((i64)blk.b * blk.H + blk.h) * Nq;
    blk.qt = query_tiles(blk.k0, KEYS, Nq, blk.mp.kl, args.band_lo, args.band_hi, ROWS);
    blk.qt.begin = next_tile(map_col(blk.mp, blockIdx.z), map_stride(blk.mp), blk.qt.begin, blk.qt.end);
    return blk;
}

// Li (log2 units) and Di of the query tile i0..i0+ROWS-1 into shared memory
// (rows past Nq: Li = -inf, Di = 0), one row a thread.
template <int ROWS>
__device__ __forceinline__ void load_row_stats(float *Li, float *Di, const float *L2vec, const float *Dvec,
                                               i64 row_base, int i0, int Nq, int tid) {
    if (tid < ROWS) {
        const int i = i0 + tid;
        Li[tid] = (i < Nq) ? L2vec[row_base + i] : NEG_INF;
        Di[tid] = (i < Nq) ? Dvec[row_base + i] : 0.f;
    }
}

// ---------------------------------------------------------------- epilogue

// Store columns d and d+1 of a float row, those below D (vec: unused, for
// the 16-bit overloads' 4-byte pair stores); the _scaled form stores x * s.
__device__ __forceinline__ void store_pair(float *row, int d, int D, float x0, float x1, bool vec) {
    (void)vec;
    if (d < D) row[d] = x0;
    if (d + 1 < D) row[d + 1] = x1;
}
__device__ __forceinline__ void store_pair_scaled(float *row, int d, int D, float x0, float x1, float s, bool vec) {
    (void)vec;
    if (d < D) row[d] = x0 * s;
    if (d + 1 < D) row[d + 1] = x1 * s;
}

// The end of the forward for output row i = i0 + 8r of this thread (row r of
// its C fragments): li, summed over the 4 lanes of the quad, divides Oi
// (acc(n, e): column 8n + 2t + e, NT 8-column tiles; columns >= D are not
// stored) and Li = mi*ln2 + log(li) goes to LSE (unless LSE = nullptr: the
// caller needs no lse).  A row that saw no key (li = 0) gets Oi = 0,
// Li = -inf.
template <int NT, typename T, typename Acc>
__device__ __forceinline__ void store_out_row(T *Og, i64 o_sn, float *LSE, int b, int h, i64 l_sb, i64 l_sh, i64 l_sn,
                                              int i0, int r, int Nq, int D, int t, float m, float l, bool vec,
                                              Acc acc) {
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const float inv_l = (l > 0.f) ? 1.f / l : 0.f;
    const int i = i0 + 8 * r;
    if (i < Nq) {
        T *orow = Og + (i64)i * o_sn;
#pragma unroll
        for (int n = 0; n < NT; ++n) store_pair_scaled(orow, 8 * n + 2 * t, D, acc(n, 0), acc(n, 1), inv_l, vec);
        if (t == 0 && LSE)
            LSE[(i64)b * l_sb + (i64)h * l_sh + (i64)i * l_sn] = (l > 0.f) ? m * LN2 + logf(l) : NEG_INF;
    }
}

// ------------------------------------------------- backward row kernels
// The preprocess and dQ conversion kernels of the backward work on rows of
// (B, H, Nq): PRE_ROWS consecutive rows per warp (a lane's loads for all of
// them issued together), PRE_WARPS warps a block (both from the compiler,
// which sizes their grids by them too).
#ifndef PRE_ROWS
#error "PRE_ROWS must be defined (pycudaflash.compiler.LAYOUT)"
#endif
#ifndef PRE_WARPS
#error "PRE_WARPS must be defined (pycudaflash.compiler.LAYOUT)"
#endif
#define PRE_THREADS (PRE_WARPS * WARP_SIZE)
// Blocks of those kernels an SM must hold at once (their registers capped to
// fit): they are memory-bound, and latency is hidden by warps in flight.
#define PRE_MIN_BLOCKS 3

// First row of this warp's PRE_ROWS.
__device__ __forceinline__ i64 warp_first_row() {
    return ((i64)blockIdx.x * (PRE_THREADS / WARP_SIZE) + threadIdx.x / WARP_SIZE) * PRE_ROWS;
}

// (b, h, i) of row (b*H + h)*Nq + i, found once per row for every array
// the row touches.  32-bit divisions where the rows fit, as they nearly
// always do (a 64-bit division is a long emulated sequence, and these
// kernels do little else).
struct RowCoord {
    i64 b, h, i;
};
__device__ __forceinline__ RowCoord row_coord(i64 row, int H, int Nq) {
    if (row <= 0xffffffffll) {
        const unsigned r = (unsigned)row, bh = r / (unsigned)Nq;
        return {(i64)(bh / (unsigned)H), (i64)(bh % (unsigned)H), (i64)(r - bh * (unsigned)Nq)};
    }
    const i64 bh = row / Nq;
    return {bh / H, bh % H, row - bh * Nq};
}

// Element (b, h, i) of a strided (B, H, Nq, ...) array.
template <typename T>
__device__ __forceinline__ T *row_ptr(T *base, const RowCoord &c, i64 sb, i64 sh, i64 sn) {
    return base + c.b * sb + c.h * sh + c.i * sn;
}

// Di = rowsum(dOi o Oi) (float32) and Li * log2(e) of this warp's rows into
// contiguous (B, H, Nq) arrays (rows with Li = -inf keep -inf); the warp
// also zeroes its rows of the dQ accumulator when there is one.  to_f
// converts an input element to float.  With `vec` (rows of dO and O in
// whole 16-byte chunks, 16-byte aligned) the warp takes its PRE_ROWS rows
// at once, WARP_SIZE / PRE_ROWS lanes a row, a 16-byte load a chunk; else
// one row after another, an element a lane.
template <typename T, typename ToF>
__device__ __forceinline__ void preprocess_rows(const T *dO, const T *O, const float *LSE, float *Dvec, float *L2vec,
                                                float *dQacc, int H, int Nq, int D, i64 total_rows, i64 do_sb,
                                                i64 do_sh, i64 do_sn, i64 o_sb, i64 o_sh, i64 o_sn, i64 l_sb,
                                                i64 l_sh, i64 l_sn, bool vec, ToF to_f) {
    static_assert(WARP_SIZE % PRE_ROWS == 0, "a whole number of lanes a row");
    const i64 row0 = warp_first_row();
    const int lane = threadIdx.x % WARP_SIZE;
    if (row0 >= total_rows) return;
    if (dQacc != nullptr) {
        // The warp's rows are contiguous: n floats from a 16-byte boundary
        // (row0 is a multiple of PRE_ROWS, itself of 4; the accumulator 256-byte aligned).
        float *z = dQacc + row0 * D;
        const i64 n = min((i64)PRE_ROWS, total_rows - row0) * D, n4 = n / 4;
        for (i64 c = lane; c < n4; c += WARP_SIZE) reinterpret_cast<float4 *>(z)[c] = make_float4(0.f, 0.f, 0.f, 0.f);
        for (i64 c = 4 * n4 + lane; c < n; c += WARP_SIZE) z[c] = 0.f;
    }
    if (vec) {
        constexpr int LPR = WARP_SIZE / PRE_ROWS, VEC = 16 / (int)sizeof(T);
        const int r = lane / LPR, sub = lane % LPR;
        // (rows past the end repeat the last, unstored)
        const RowCoord c = row_coord(min(row0 + r, total_rows - 1), H, Nq);
        const T *dorow = row_ptr(dO, c, do_sb, do_sh, do_sn), *orow = row_ptr(O, c, o_sb, o_sh, o_sn);
        // (Li read with the row's loads, not after the sum: one memory latency a warp, not two)
        const float li = sub == 0 ? *row_ptr(LSE, c, l_sb, l_sh, l_sn) : 0.f;
        float acc = 0.f;
        // (unrolled over the bucket's head dim, so that a lane's loads are issued together)
        constexpr int STEPS = (HEAD_DIM + LPR * VEC - 1) / (LPR * VEC);
#pragma unroll
        for (int s = 0; s < STEPS; ++s) {
            const int k = (s * LPR + sub) * VEC;
            if (k < D) {
                const uint4 a = *reinterpret_cast<const uint4 *>(dorow + k);
                const uint4 b = *reinterpret_cast<const uint4 *>(orow + k);
                const T *x = reinterpret_cast<const T *>(&a), *y = reinterpret_cast<const T *>(&b);
#pragma unroll
                for (int e = 0; e < VEC; ++e) acc = fmaf(to_f(x[e]), to_f(y[e]), acc);
            }
        }
        // Sum over the LPR lanes of the row (aligned groups of lanes).
#pragma unroll
        for (int off = LPR / 2; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
        if (sub == 0 && row0 + r < total_rows) {
            Dvec[row0 + r] = acc;
            L2vec[row0 + r] = li * LOG2E;
        }
        return;
    }
    // (four rows at a time: the pointers of all PRE_ROWS would not fit the registers)
    constexpr int G = 4;
    static_assert(PRE_ROWS % G == 0, "whole groups of rows");
    for (int g0 = 0; g0 < PRE_ROWS && row0 + g0 < total_rows; g0 += G) {
        const T *dorow[G], *orow[G];
        float li[G], acc[G];
#pragma unroll
        for (int r = 0; r < G; ++r) {
            // (rows past the end repeat the last, unstored)
            const RowCoord c = row_coord(min(row0 + g0 + r, total_rows - 1), H, Nq);
            dorow[r] = row_ptr(dO, c, do_sb, do_sh, do_sn);
            orow[r] = row_ptr(O, c, o_sb, o_sh, o_sn);
            li[r] = lane == 0 ? *row_ptr(LSE, c, l_sb, l_sh, l_sn) : 0.f;  // (in flight with the rows)
            acc[r] = 0.f;
        }
        for (int d = lane; d < D; d += WARP_SIZE)
#pragma unroll
            for (int r = 0; r < G; ++r) acc[r] = fmaf(to_f(dorow[r][d]), to_f(orow[r][d]), acc[r]);
#pragma unroll
        for (int r = 0; r < G; ++r) {
#pragma unroll
            for (int off = WARP_SIZE / 2; off > 0; off >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], off);
            const i64 row = row0 + g0 + r;
            if (lane == 0 && row < total_rows) {
                Dvec[row] = acc[r];
                L2vec[row] = li[r] * LOG2E;
            }
        }
    }
}

// dq rows of this warp from the float32 accumulator (contiguous rows of D,
// already scaled).  With `vec` (rows of dq in whole 16-byte chunks, 16-byte
// aligned) the warp takes its PRE_ROWS rows at once, WARP_SIZE / PRE_ROWS
// lanes a row, a chunk of 16 / sizeof(T) elements a store (from_f rounds
// one element); else store(row, d, x0, x1) writes columns d and d+1 (the
// latter only where d+1 < D), a column pair a lane.
template <typename T, typename FromF, typename Store>
__device__ __forceinline__ void convert_dq_rows(const float *dQacc, T *dQ, int H, int Nq, int D, i64 total_rows,
                                                i64 dq_sb, i64 dq_sh, i64 dq_sn, bool vec, FromF from_f,
                                                Store store) {
    const i64 row0 = warp_first_row();
    const int lane = threadIdx.x % WARP_SIZE;
    if (row0 >= total_rows) return;
    const int rows = (int)min((i64)PRE_ROWS, total_rows - row0);
    const float *src = dQacc + row0 * D;
    if (vec) {
        constexpr int LPR = WARP_SIZE / PRE_ROWS, VEC = 16 / (int)sizeof(T), F4 = VEC / 4;
        constexpr int STEPS = (HEAD_DIM + LPR * VEC - 1) / (LPR * VEC);
        constexpr int G = STEPS < 4 ? STEPS : 4;  // chunks a lane has in flight
        const int r = lane / LPR, sub = lane % LPR;
        if (r >= rows) return;
        // (a chunk of the accumulator: 4 * VEC bytes from a multiple of 16, D being one of VEC)
        const float4 *srow = reinterpret_cast<const float4 *>(src + (i64)r * D);
        T *drow = row_ptr(dQ, row_coord(row0 + r, H, Nq), dq_sb, dq_sh, dq_sn);
        for (int s0 = 0; s0 < STEPS; s0 += G) {
            float4 x[G][F4];
#pragma unroll
            for (int g = 0; g < G; ++g) {
                const int k = ((s0 + g) * LPR + sub) * VEC;
                if (s0 + g < STEPS && k < D)
#pragma unroll
                    for (int f = 0; f < F4; ++f) x[g][f] = srow[k / 4 + f];
            }
#pragma unroll
            for (int g = 0; g < G; ++g) {
                const int k = ((s0 + g) * LPR + sub) * VEC;
                if (s0 + g < STEPS && k < D) {
                    union {
                        uint4 u;
                        T e[VEC];
                    } y;
#pragma unroll
                    for (int f = 0; f < F4; ++f) {
                        y.e[4 * f] = from_f(x[g][f].x);
                        y.e[4 * f + 1] = from_f(x[g][f].y);
                        y.e[4 * f + 2] = from_f(x[g][f].z);
                        y.e[4 * f + 3] = from_f(x[g][f].w);
                    }
                    *reinterpret_cast<uint4 *>(drow + k) = y.u;
                }
            }
        }
        return;
    }
    // Column pairs (d, d+1), four rows at a time; with D even a pair is one aligned float2.
    constexpr int G = 4;
    static_assert(PRE_ROWS % G == 0, "whole groups of rows");
    for (int g0 = 0; g0 < rows; g0 += G)
        for (int d = 2 * lane; d < D; d += 2 * WARP_SIZE) {
            float2 x[G];
#pragma unroll
            for (int r = 0; r < G; ++r) {
                const float *p = src + (i64)min(g0 + r, rows - 1) * D + d;
                if ((D & 1) == 0) {
                    x[r] = *reinterpret_cast<const float2 *>(p);
                } else {
                    x[r].x = p[0];
                    x[r].y = (d + 1 < D) ? p[1] : 0.f;
                }
            }
#pragma unroll
            for (int r = 0; r < G; ++r)
                if (g0 + r < rows)
                    store(row_ptr(dQ, row_coord(row0 + g0 + r, H, Nq), dq_sb, dq_sh, dq_sn), d, x[r].x, x[r].y);
        }
}

// The K/V head that query head h reads: h / kv_group (= H / Hkv) in the
// grouped-query variants (KV_GROUPS 1), h itself in the others, where the
// division is compiled out.
#ifndef KV_GROUPS
#error "KV_GROUPS must be defined (pycudaflash.compiler.defines)"
#endif
__device__ __forceinline__ int kv_head(int h, int kv_group) { return KV_GROUPS ? h / kv_group : h; }

// Grouped K/V heads: dKj (or dVj) of K/V head hk is the sum of the G = H /
// Hkv per-query-head terms of its group, which the dK/dV kernel wrote, each
// rounded to the element type, into a contiguous (B, H, Nk, D) workspace
// `src` (query heads hk*G .. hk*G + G - 1 in a row).  Summed in float32 in a
// fixed order (deterministic); one thread per element of `dst` (strided).
template <typename T, typename ToF, typename Store>
__device__ __forceinline__ void sum_head_groups(const T *src, T *dst, int Hkv, int G, int Nk, int D, i64 total,
                                                i64 d_sb, i64 d_sh, i64 d_sn, ToF to_f, Store store) {
    for (i64 e = blockIdx.x * (i64)blockDim.x + threadIdx.x; e < total; e += (i64)gridDim.x * blockDim.x) {
        const int d = (int)(e % D);
        const i64 row = e / D;  // (b, hk, j)
        const int j = (int)(row % Nk);
        const i64 bhk = row / Nk;  // b * Hkv + hk
        const int hk = (int)(bhk % Hkv), b = (int)(bhk / Hkv);
        const T *s = src + (bhk * G * Nk + j) * D + d;  // query head hk*G of batch b, key j, column d
        float acc = 0.f;
        for (int g = 0; g < G; ++g) acc += to_f(s[(i64)g * Nk * D]);
        store(dst + (i64)b * d_sb + (i64)hk * d_sh + (i64)j * d_sn + d, acc);
    }
}
