// flash_params.cuh -- the scalar parameters of every kernel, in one struct.
//
// A kernel takes its arrays as `__restrict__` pointer parameters (only those
// does the compiler treat as not aliasing one another, and it loads the
// read-only ones by the non-coherent path), then at most the sizes Nq, Nk, D,
// then `const __grid_constant__ AttnParams args`, read in place from the
// parameter space as separate parameters would be.
//
// pycudaflash.compiler reads the fields and their C layout from this file
// and the launch code fills them by name (pycudaflash.cuda_backend), one
// struct per call signature shared by all its kernels; a field that a pass
// does not use stays 0.  Fields are i64, int, u32, float, unsigned long
// long or a struct of the source, arrays of those, one declaration a line or
// several names of one type; `#if` lines over the variant's defines may
// leave fields out.
//
// Strides are in elements: x_sb, x_sh, x_sn step array x by one batch, head
// and row (its last dimension is contiguous); a dense mask has m_sb, m_sh,
// m_sq, m_sk (0 on broadcast dimensions).

#pragma once

// A tensor map as a kernel receives it (pycudaflash._tma, flash_tma.cuh): 128
// opaque bytes, 64-byte aligned, here a member of the parameter struct.
struct alignas(64) TmaMap {
    unsigned long long opaque[16];
};

struct AttnParams {
    // Both passes.
    i64 q_sb, q_sh, q_sn;
    i64 k_sb, k_sh, k_sn;
    i64 v_sb, v_sh, v_sn;
    i64 m_sb, m_sh, m_sq, m_sk;
    float scale_log2;            // softmax scale * log2(e)
    int band_lo, band_hi;        // row i sees keys i + band_lo <= j <= i + band_hi
    int vec;                     // 16-byte loads (and paired 16-bit stores) allowed
    int H;                       // query heads
    int kv_group;                // query heads per K/V head: head h reads K/V head h / kv_group

    // Forward: out, lse; the Hopper forward's job list (query tiles of all
    // heads, log2 of the heads of a job group).
    i64 o_sb, o_sh, o_sn;
    i64 l_sb, l_sh, l_sn;
    int n_jobs, group_shift;

    // Backward: dO, dQ; dK, dV as the dK/dV kernel writes them (dkh, dvh:
    // per query head, in the workspace with grouped K/V heads) and as the
    // caller receives them (dk, dv); the softmax scale (also the forward's,
    // with a score modifier); rows B * H * Nq.
    i64 do_sb, do_sh, do_sn;
    i64 dq_sb, dq_sh, dq_sn;
    i64 dkh_sb, dkh_sh, dkh_sn;
    i64 dvh_sb, dvh_sh, dvh_sn;
    i64 dk_sb, dk_sh, dk_sn;
    i64 dv_sb, dv_sh, dv_sn;
    float scale;
    i64 total_rows;
    int rows_vec;                // the row kernels may load rows of dO and O in 16-byte chunks
    int dq_vec;                  // the dQ conversion may store rows of dq in 16-byte chunks
    int Hkv;                     // K/V heads
    i64 kv_total;                // elements of dk (B * Hkv * Nk * D)

    // A 16-bit float mask as given (flash_convert_mask turns it into the
    // float32 mask, contiguous, shape (B or 1, mask_n1, mask_n2, mask_n3) with
    // size 1 on broadcast dimensions): its strides, that shape.
    i64 src_sb, src_sh, src_sq, src_sk;
    i64 mask_n1, mask_n2, mask_n3, mask_total;

#if SCORE_MOD || MASK_MOD
    // The tensors the score and mask modifiers read (their data addresses
    // written by each call).
    ModTensors mods;
#endif
#if FWD_TMA
    // The tensor maps of q, k and v (flash_fwd_sm90_tma.cu), encoded for
    // each call's addresses.
    TmaMap q_map, k_map, v_map;
#endif
};
