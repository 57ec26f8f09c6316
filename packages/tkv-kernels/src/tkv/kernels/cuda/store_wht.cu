// Fused compress + store of new K/V tokens into the paged tkv cache, hand-written CUDA
// (compiled at run time by NVRTC; tkv.kernels.cuda_store builds the defines and launches it).
//
// The computation of compress_store(rotation="wht") (tkv/kernels/store.py), per token, KV
// head and side: xf = x − μ (keys with a channel offset), n = ‖xf/s‖, y = (w ⊙ xf) @ H by
// Walsh–Hadamard butterflies (w = the rotation's signs, 1/s and 1/√d), Lloyd-Max codes of
// z = √d·y/n packed LSB-first, and the bf16 norm (keys: norm-corrected; with sink offsets the
// candidate with the smaller reconstruction error, y or y − c_h, the latter flagged by the
// norm's sign bit) — TurboQuant (Zandieh et al. 2025, Alg. 1).
//
// Work layout. One vector = LPV = D/E consecutive lanes, each holding E consecutive
// coordinates in registers: log2(E) butterfly stages run inside a lane, log2(LPV) across lanes
// by shuffles (a stage is one shuffle and one FMA per coordinate: y' = partner ± y); norms
// and error sums are butterfly reductions over the LPV lanes, so every lane of a vector holds
// them. A CTA of WARPS warps serves one (KV head, side) and a grid-stride range of tokens:
// warp w of CTA b takes token groups (VPW = 32/LPV tokens each) b·WARPS + w, then
// + gridDim.x·WARPS, ...; the next group's loads are issued before the current one is
// computed. The per-coordinate constants (w, μ, the sink shift and delta, 1/s) stay in
// registers; the norm comes from the rotated vector (‖y‖ = ‖(x − μ)/s‖: H Hᵀ = d·I and w
// carries 1/√d), the sink candidate's from before the rotation (exactly 0 at the offset).
//
// Quantization without a search (tkv.kernels._quant_grid builds the side's table): the
// interval around the boundaries is cut into NCELL cells, no two boundaries in one cell
// (with a float32 rounding margin). A coordinate's cell is one saturated FMA and a rounding
// FMA (the 1.5·2^23 trick), the cell's byte gives 4·c (c = the boundaries below the cell),
// and one compare with boundary c decides c or c + 1: code = #{b_j < z}, the codec's rule.
// NCELL = 0 (a codebook whose boundaries are too close for 256 cells): a binary search over
// the boundaries in shared memory.
//
// Defines (all required): HEAD_DIM (64, 128, 256), E (coordinates per lane: 8 or 16), WARPS,
// BLOCK_SIZE (tokens per page), K_MU (1: keys have a channel offset μ), and per side S = K, V:
// S_BITS (2..8), S_KIND (0 float32, 1 bfloat16, 2 float16 input), S_NC (1: norm correction),
// S_SINK (1: sink offsets), S_NCELL (the table's cells; 0: binary search), S_ALIGN (bytes,
// 1..16: the alignment every lane's code store is guaranteed).

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef unsigned long long u64;

#define D HEAD_DIM
#define LPV (D / E)            // lanes per vector
#define VPW (32 / LPV)         // vectors (tokens) per warp and group
#define QT_HEADER 16           // table bytes before the boundaries (A, B, NCELL, pad)
#define QT_MAX (QT_HEADER + 12 * 256 + 256)

__device__ __forceinline__ float fma_sat(float a, float b, float c) {
  float d;
  asm("fma.rn.sat.f32 %0, %1, %2, %3;" : "=f"(d) : "f"(a), "f"(b), "f"(c));
  return d;
}

// float32 -> bf16 bits, round to nearest even, NaN -> 0x7FC0 (store.py's _bf16_rne, bit for bit)
__device__ __forceinline__ u32 bf16_rne(float x) {
  const u32 b = __float_as_uint(x);
  const u32 r = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
  return x == x ? (r & 0xFFFFu) : 0x7FC0u;
}

__device__ __forceinline__ float bf16_float(u32 bits) { return __uint_as_float(bits << 16); }

template <int KIND>
struct Raw {   // one lane's E input elements as loaded (16-byte vectors)
  static constexpr int WORDS = KIND == 0 ? E : E / 2;
  uint4 v[WORDS / 4];
};

template <int KIND>
__device__ __forceinline__ void load_raw(Raw<KIND>& r, const void* base, long long elem) {
  const uint4* p = (const uint4*)((const char*)base + elem * (KIND == 0 ? 4 : 2));
#pragma unroll
  for (int i = 0; i < Raw<KIND>::WORDS / 4; ++i) r.v[i] = __ldg(p + i);
}

template <int KIND>
__device__ __forceinline__ float raw_elem(const Raw<KIND>& r, int e) {
  const u32* w = (const u32*)r.v;
  if (KIND == 0) return __uint_as_float(w[e]);
  const u32 h = (e & 1) ? (w[e >> 1] >> 16) : (w[e >> 1] & 0xFFFFu);
  if (KIND == 1) return __uint_as_float(h << 16);
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((u16)h));
  return f;
}

__device__ __forceinline__ float lane_sum(float v) {
#pragma unroll
  for (int m = 1; m < LPV; m <<= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
  return v;
}

__device__ __forceinline__ u32 lds_u8(u32 a) {
  u32 d;
  asm volatile("ld.shared.u8 %0, [%1];" : "=r"(d) : "r"(a));
  return d;
}

__device__ __forceinline__ float lds_f32(u32 a) {
  float d;
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(d) : "r"(a));
  return d;
}

// One coordinate y of a vector whose scale is ia = A·sqrt(d)/n: its code as (c4, p) with
// code = c4/4 + p (c4 = 4·c, c the boundaries below the cell; p: the cell's one boundary
// lies below y). Grid mode works in u = sat(y·ia + B), where the table's boundaries are
// A·b_j + B (tkv.kernels._quant_grid); NCELL = 0: a binary search on z = y·ia (ia =
// sqrt(d)/n then) over the standardized boundaries, p = false. `qt`: the table's
// shared-memory address.
template <int BITS, int NCELL>
__device__ __forceinline__ void quantize(float y, float ia, float B, u32 qt, u32& c4, bool& p) {
  const u32 bounds = qt + QT_HEADER;
  if (NCELL > 0) {
    const float u = fma_sat(y, ia, B);
    const float v = __fmaf_rn(u, (float)(NCELL - 1), 12582912.0f);   // 1.5·2^23 + rint(u·(N−1))
    c4 = lds_u8(qt + (QT_HEADER + 12 * (1 << BITS) - 0x4B400000u) + __float_as_uint(v));
    p = lds_f32(bounds + c4) < u;
  } else {
    const float z = y * ia;
    u32 c = 0;
#pragma unroll
    for (int s = BITS - 1; s >= 0; --s)
      if (lds_f32(bounds + 4 * (c + (1u << s) - 1)) < z) c += 1u << s;
    c4 = 4 * c;
    p = false;
  }
}

// E codes of BITS bits packed LSB-first into W (E·BITS/32 words, rounded up)
template <int BITS>
struct Packed {
  static constexpr int BYTES = E * BITS / 8;
  static constexpr int WORDS = (BYTES + 3) / 4;
  u32 w[WORDS];
};

// add code i = c4/4 + p to the packed words (zero-initialized); widths dividing 32 never
// cross a word: c4·2^(sh−2) and a predicated add of 2^sh, the first code of a word a shift
template <int BITS>
__device__ __forceinline__ void pack_code(Packed<BITS>& pk, int i, u32 c4, bool p) {
  const int bp = i * BITS, wi = bp >> 5, sh = bp & 31;
  if (32 % BITS == 0) {
    if (sh == 0) pk.w[wi] = c4 >> 2;
    else pk.w[wi] += c4 << (sh - 2);
    if (p) pk.w[wi] += 1u << sh;
  } else {
    const u32 code = (c4 >> 2) + (p ? 1u : 0u);
    pk.w[wi] |= code << sh;
    if (sh + BITS > 32) pk.w[wi + 1] |= code >> (32 - sh);
  }
}

// a lane's E coordinates y (vector scale ia) coded and packed into pk; with T2 the sum of
// the codes' squared scaled centroids t into u, with TY also Σ t·y into c. t is t_c or
// t_{c+1}, both at offset c4 of the table's two centroid rows (no address select).
template <int BITS, int NCELL, bool T2, bool TY>
__device__ __forceinline__ void code_vector(const float* y, float ia, float B, u32 qt, u32 cent,
                                            Packed<BITS>& pk, float& u, float& c) {
#pragma unroll
  for (int e = 0; e < E; ++e) {
    u32 c4;
    bool p;
    quantize<BITS, NCELL>(y[e], ia, B, qt, c4, p);
    pack_code<BITS>(pk, e, c4, p);
    if (T2) {
      const float t = p ? lds_f32(cent + 4 * (1 << BITS) + c4) : lds_f32(cent + c4);
      u = __fmaf_rn(t, t, u);
      if (TY) c = __fmaf_rn(t, y[e], c);
    }
  }
}

// store the packed bytes at `dst` in units of U bytes (U divides BYTES and dst's alignment)
template <int BITS, int ALIGN>
__device__ __forceinline__ void store_codes(u8* dst, const Packed<BITS>& p) {
  constexpr int N = Packed<BITS>::BYTES;
  constexpr int U = (N % 16 == 0 && ALIGN >= 16) ? 16 : (N % 8 == 0 && ALIGN >= 8) ? 8
                  : (N % 4 == 0 && ALIGN >= 4) ? 4 : (N % 2 == 0 && ALIGN >= 2) ? 2 : 1;
  if (U == 16) {
#pragma unroll
    for (int i = 0; i < N / 16; ++i)
      ((uint4*)dst)[i] = make_uint4(p.w[4 * i], p.w[4 * i + 1], p.w[4 * i + 2], p.w[4 * i + 3]);
  } else if (U == 8) {
#pragma unroll
    for (int i = 0; i < N / 8; ++i) ((uint2*)dst)[i] = make_uint2(p.w[2 * i], p.w[2 * i + 1]);
  } else if (U == 4) {
#pragma unroll
    for (int i = 0; i < N / 4; ++i) ((u32*)dst)[i] = p.w[i];
  } else if (U == 2) {
#pragma unroll
    for (int i = 0; i < N / 2; ++i) ((u16*)dst)[i] = (u16)(p.w[i >> 1] >> (16 * (i & 1)));
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) dst[i] = (u8)(p.w[i >> 2] >> (8 * (i & 3)));
  }
}

struct Args {
  const void* x; int sxt, sxh;
  int codes_off, head_stride, tok_stride, norms_off;
  const float* w; const float* mu; int mu_sh; const float* shift; const float* delta;
  const float* inv_s; const u8* qt;
};

// fast norms: n = ss·rsqrt(ss) and the vector's scale k·rsqrt(ss) (0 where ss is 0, inf or
// NaN; n then ss itself: 0, inf, NaN as store.py stores them) — within a few float32 ulps of
// sqrt_rn / div_rn, below the bf16 norm's rounding and the codes' float32 ties
__device__ __forceinline__ void norm_scale(float ss, float k, float& n, float& scale) {
  const float r = rsqrtf(ss);
  const bool ok = ss > 0.f && ss < __int_as_float(0x7f800000);
  n = ok ? ss * r : ss;
  scale = ok ? k * r : 0.f;
}

template <int BITS, int KIND, int MU, int NC, int SINK, int NCELL, int ALIGN>
__device__ __forceinline__ void store_side(const Args& a, const long long* slots, int num_tokens,
                                           int num_slots, u8* cache, int page_bytes,
                                           int norm_head_stride, u8* qt_smem) {
  // the side's quantization table into shared memory (16-byte words; its size is a multiple)
  constexpr int QT_BYTES = (QT_HEADER + 12 * (1 << BITS) + NCELL + 15) / 16 * 16;
  for (int i = threadIdx.x; i < QT_BYTES / 16; i += WARPS * 32)
    ((uint4*)qt_smem)[i] = __ldg((const uint4*)a.qt + i);
  __syncthreads();
  const u32 qt = (u32)__cvta_generic_to_shared(qt_smem);
  const float A = ((const float*)qt_smem)[0], B = ((const float*)qt_smem)[1];
  const u32 cent = qt + QT_HEADER + 4 * (1 << BITS);   // t_c; t_{c+1} follows (code_vector)
  // grid mode folds A into the vector's scale: ia = A·sqrt(d)/n
  const float k_scale = sqrtf((float)D) * (NCELL > 0 ? A : 1.f);

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int lv = lane % LPV, vi = lane / LPV;
  const int head = blockIdx.y;
  const int c0 = lv * E;
  // y = (x − μ) ⊙ w (store.py's order: a vector equal to μ gives exactly 0); the sink
  // candidate is y − c_h, its norm ‖(x − μ − δ)/s‖ taken before the rotation (δ = σ − μ: a
  // vector equal to σ gives exactly 0, as store.py)
  float w[E], mu[E], shift[E], delta[E], inv_s[E];
#pragma unroll
  for (int e = 0; e < E; ++e) {
    w[e] = __ldg(a.w + c0 + e);
    mu[e] = MU ? __ldg(a.mu + head * a.mu_sh + c0 + e) : 0.f;
    shift[e] = SINK ? __ldg(a.shift + head * D + c0 + e) : 0.f;
    delta[e] = SINK ? __ldg(a.delta + head * D + c0 + e) : 0.f;
    inv_s[e] = SINK ? __ldg(a.inv_s + c0 + e) : 0.f;
  }
  // this lane's bytes of head `head` in page 0; a token adds blk·page_bytes + off·tok_stride
  u8* const codes0 = cache + a.codes_off + (long long)head * a.head_stride + lv * Packed<BITS>::BYTES;
  u8* const norms0 = cache + a.norms_off + 2 * (long long)head * norm_head_stride;
  const char* const x0 = (const char*)a.x + ((long long)head * a.sxh + c0) * (KIND == 0 ? 4 : 2);
  const long long xstride = (long long)a.sxt * (KIND == 0 ? 4 : 2);

  const int ngroups = (num_tokens + VPW - 1) / VPW;
  const int gstep = gridDim.x * WARPS;
  int g = blockIdx.x * WARPS + warp;
  Raw<KIND> nxt;
  long long nslot = -1;
  auto fetch = [&](int grp) {
    const int tok = grp * VPW + vi;
    if (grp < ngroups && tok < num_tokens) {
      load_raw<KIND>(nxt, x0 + tok * xstride, 0);
      nslot = __ldg(slots + tok);
    } else {
      nslot = -1;
#pragma unroll
      for (int i = 0; i < Raw<KIND>::WORDS / 4; ++i) nxt.v[i] = make_uint4(0, 0, 0, 0);
    }
  };
  fetch(g);
#pragma unroll 1
  for (; g < ngroups; g += gstep) {   // g is warp-uniform: every lane runs every shuffle
    const Raw<KIND> cur = nxt;
    const long long slot = nslot;
    fetch(g + gstep);

    float y[E], ssb = 0.f;
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const float xf = MU ? raw_elem<KIND>(cur, e) - mu[e] : raw_elem<KIND>(cur, e);
      y[e] = xf * w[e];
      if (SINK) {
        const float xb = (xf - delta[e]) * inv_s[e];
        ssb = __fmaf_rn(xb, xb, ssb);
      }
    }
#pragma unroll
    for (int h = 1; h < E; h <<= 1)
#pragma unroll
      for (int e = 0; e < E; ++e)
        if (!(e & h)) {
          const float p = y[e], q = y[e + h];
          y[e] = p + q;
          y[e + h] = p - q;
        }
#pragma unroll
    for (int m = 1; m < LPV; m <<= 1) {
      const float sg = (lv & m) ? -1.f : 1.f;
#pragma unroll
      for (int e = 0; e < E; ++e) y[e] = __fmaf_rn(sg, y[e], __shfl_xor_sync(0xffffffffu, y[e], m));
    }
    // ‖y‖² = ‖(x − μ)/s‖² (H Hᵀ = d·I and w carries 1/√d)
    float ss = 0.f;
#pragma unroll
    for (int e = 0; e < E; ++e) ss = __fmaf_rn(y[e], y[e], ss);
    ss = lane_sum(ss);
    float n, ia;
    norm_scale(ss, k_scale, n, ia);

    Packed<BITS> pa = {};
    float ua = 0.f, ca = 0.f;
    code_vector<BITS, NCELL, NC || SINK, SINK>(y, ia, B, qt, cent, pa, ua, ca);
    u32 norm_bits;
    if (SINK) {
      Packed<BITS> pb = {};
      float yb[E];
#pragma unroll
      for (int e = 0; e < E; ++e) yb[e] = y[e] - shift[e];
      ssb = lane_sum(ssb);
      float nb, iab;
      norm_scale(ssb, k_scale, nb, iab);
      float ub = 0.f, cb = 0.f;
      code_vector<BITS, NCELL, true, true>(yb, iab, B, qt, cent, pb, ub, cb);
      ua = lane_sum(ua); ca = lane_sum(ca); ub = lane_sum(ub); cb = lane_sum(cb);
      if (NC) {   // ‖x̂‖ = ‖x‖: n / ‖t‖
        n *= rsqrtf(fmaxf(ua, 1e-24f));
        nb *= rsqrtf(fmaxf(ub, 1e-24f));
      }
      const float ha = bf16_float(bf16_rne(n)), hb = bf16_float(bf16_rne(nb));
      const float ea = ha * ha * ua - 2.f * ha * ca + ss;   // ‖n̂·t − y‖², expanded
      const float eb = hb * hb * ub - 2.f * hb * cb + ssb;
      const bool pick = (eb < ea) || (ea != ea && eb == eb);
      norm_bits = pick ? (bf16_rne(nb) | 0x8000u) : bf16_rne(n);
#pragma unroll
      for (int i = 0; i < Packed<BITS>::WORDS; ++i) pa.w[i] = pick ? pb.w[i] : pa.w[i];
    } else {
      if (NC) n *= rsqrtf(fmaxf(lane_sum(ua), 1e-24f));
      norm_bits = bf16_rne(n);
    }
    if (slot >= 0 && slot < num_slots) {
      const u32 s32 = (u32)slot, blk = s32 / BLOCK_SIZE, off = s32 % BLOCK_SIZE;
      const unsigned long long page = (unsigned long long)blk * (u32)page_bytes;
      store_codes<BITS, ALIGN>(codes0 + page + off * (u32)a.tok_stride, pa);
      if (lv == 0) *(u16*)(norms0 + page + 2 * off) = (u16)norm_bits;
    }
  }
}

extern "C" __global__ void __launch_bounds__(WARPS * 32) tkv_store_wht(
    const void* K, int skt, int skh, const void* V, int svt, int svh, const long long* slots,
    int num_tokens, int num_slots, u8* cache, int page_bytes,
    int k_codes_off, int k_head_stride, int k_tok_stride, int k_norms_off,
    int v_codes_off, int v_head_stride, int v_tok_stride, int v_norms_off, int norm_head_stride,
    const float* kw, const float* vw, const float* kmu, int kmu_sh, const float* kshift,
    const float* vshift, const float* kdelta, const float* vdelta, const float* kinv_s,
    const float* vinv_s, const u8* kqt, const u8* vqt) {
  __shared__ __align__(16) u8 qt_smem[QT_MAX];
  if (blockIdx.z == 0) {
    const Args a = {K, skt, skh, k_codes_off, k_head_stride, k_tok_stride, k_norms_off,
                    kw, kmu, kmu_sh, kshift, kdelta, kinv_s, kqt};
    store_side<K_BITS, K_KIND, K_MU, K_NC, K_SINK, K_NCELL, K_ALIGN>(
        a, slots, num_tokens, num_slots, cache, page_bytes, norm_head_stride, qt_smem);
  } else {
    const Args a = {V, svt, svh, v_codes_off, v_head_stride, v_tok_stride, v_norms_off,
                    vw, kmu, 0, vshift, vdelta, vinv_s, vqt};
    store_side<V_BITS, V_KIND, 0, V_NC, V_SINK, V_NCELL, V_ALIGN>(
        a, slots, num_tokens, num_slots, cache, page_bytes, norm_head_stride, qt_smem);
  }
}
