// Split-K paged decode for 4-bit K and V sides, hand-written CUDA (compiled at run time by
// NVRTC; tkv.kernels.cuda_decode builds the defines and launches it).
//
// One CTA = one (sequence, KV head, split), WARPS warps (or, with TEAMS, two KV heads served
// by two teams of WARPS / 2 warps when the split is short). The split's tokens are cut into
// 16-token *steps*; warp w of a team of tw takes steps w, w + tw, ... and keeps its own
// online-softmax state, so P never leaves the warp; the team's warps' states are merged once,
// at the end.
//
// Per step and warp, two tensor-core products (mma.m16n8k16, f32 accumulate):
//   S^T[16 tokens][8 heads] = K[16 tokens][D] · q^T[D][8 heads]
//       K is the A operand: lane (g, t) holds tokens g and g+8, and the dot's k index is a
//       relabelling of the code bytes — lane t's D/8 contiguous bytes of a token — so one
//       vector load per token feeds the lookup, whose outputs ARE the operand registers.
//       The query is loaded once, in the same relabelled order (the B operand).
//   O^T[D][8 heads] += V^T[D][16 tokens] · P^T[16 tokens][8 heads]
//       V^T is the A operand: lane (g, t) needs tokens 2t, 2t+1, 2t+8, 2t+9 and D/8
//       coordinates (rows g and g+8 of each 16-row tile) = its D/16 contiguous code bytes
//       of each of the four tokens; two tokens' bytes are interleaved by one byte permute
//       so the lookup yields (token 2t, token 2t+1) pairs. P^T comes from the S^T
//       accumulator by one movmatrix.trans per 8 tokens.
// The query heads of the GQA group (G <= 8) are the N dimension (8 columns): no M padding.
// Lookups: 16-entry byte tables in registers (PTX prmt; the same algorithms as
// tkv.kernels.loaders._prmt_lut16_asm / _prmt_sym16_asm). Loads: cp.async into a
// per-warp NST-stage ring in shared memory; every lane reads back only what it copied,
// except the 16 norm words (a __syncwarp orders those).
//
// Defines (all required): HEAD_DIM (64, 128, 256), GROUP (1..8), WARPS, SUB (16-token steps
// per loop iteration: 1 or 2, one softmax update per iteration), NST (ring stages per warp, a
// multiple of SUB, >= 2·SUB), BLOCK_SIZE (tokens per page, a multiple of 16), Q_KIND (0
// float32, 1 bfloat16, 2 float16 query), QROT (1: the query is in model space and rotated
// here as H (q_w ⊙ q)), DOT_BF16 (1: bf16 tensor-core operands and tables, 0: fp16), K_SYM /
// V_SYM (1: the antisymmetric-table lookup), EPILOGUE (0: the split's partial row and LSE for
// the reduce kernel; 1: one split, the normalized row written to `out`; 2: the same unrotated
// as o_w ⊙ H o), OUT_KIND (0 float32, 1 bfloat16, 2 float16 `out`), K_SINK / V_SINK (1: sink
// offsets — a token whose bf16 norm has its sign bit set is flagged: a flagged key scores
// |n|·<q, k^> + <q, c_k>, a flagged value adds c_v times its softmax weight; c_k / c_v float32
// (num_kv_heads, HEAD_DIM) rotated-space shifts, as the Triton kernel), MIN_CTAS
// (__launch_bounds__ minimum CTAs per SM), LUT (0: the byte-permute lookups above; 1: a
// 256-entry pair table in shared memory, see "Shared pair tables" below), TAB_BYTES (the tables'
// share: 32768 per table, 0 with LUT 0), TAB_SAME (K and V share one table), DYN_BYTES (LUT
// 1: the dynamic shared memory of a launch, tables then the ring — checked at compile time),
// BALANCED (0: grid (sequences, KV heads, splits), one segment per CTA; 1: the balanced
// (stream-K) schedule — a 1-D grid of resident CTAs sharing the batch's steps equally, parts of
// a pair merged by the CTA that finishes last; EPILOGUE 1 or 2; see the comment at its code),
// EARLY (optional, default 0; 1: the first ring groups are issued before the query is loaded,
// rotated and packed and, with LUT 1 and the split schedule, before the pair tables are
// filled, so the first pages' DRAM latency overlaps that prologue instead of following it;
// on the split schedule also every small read of the prologue — the length, the byte tables,
// the query rows, q_w, the first groups' block-table entries — is requested into the L1 at
// entry (prefetch.global.L1) and the epilogue's o_w before the warps' merge, so the CTA waits
// for two DRAM round trips before its first copies (length, then block table) instead of one
// per read),
// TEAMS (optional, default 0; 1 with WARPS 8 and the split schedule: a sequence whose split
// holds at most `team_steps` (a kernel argument; 0: never) 16-token steps is served by two
// teams of 4 warps, one per KV head — the CTA of head 2k takes heads 2k and 2k + 1, the CTA of
// head 2k + 1 exits at once — so short contexts get 4 warps per pair and one table fill per
// two pairs, long ones 8 warps per pair; the choice is made on the device, per sequence),
// PROBE (optional, default 0; 1, split schedule only: a timeline probe — thread 0 of every CTA
// writes PROBE_WORDS u64 words to `counters` after its first ⌈num_seqs · hkv / 2⌉ u64 words
// (MERGE_SPLITS' counters; row = the CTA's linear index):
// %globaltimer (ns) at entry, after the prologue, after the first and the ninth ring wait,
// after warp 0's main loop, once every warp is done, at exit; then its SM id in the low 32
// bits of the last word and its steps (warp 0) in the high 32. benchmarks/decode_timeline_gpu.py
// reads it; no build a launch makes by default has it), MERGE_SPLITS (optional, default 0;
// 1 with EPILOGUE 1 or 2 on the split schedule with several splits: every split writes its
// partial row and LSE as EPILOGUE 0 does, and the one that finishes last — an atomicAdd on
// `counters[seq · hkv + first KV head]` after a __threadfence — merges them and writes the
// output as EPILOGUE 1 / 2 would, instead of the reduce kernel's second launch).
//
// Shared pair tables (LUT 1). Entry e (a whole code byte) holds the two 16-bit centroids of
// its low and high nibble, so one 32-bit shared load dequantizes two codes; the table is
// replicated 32 times in rows of 128 bytes, replica l in bank l, so a warp's 32 loads never
// conflict. A load's address is one byte permute (the byte, zero-extended) and one IMAD
// (FMA pipe) instead of ~4.3 integer-pipe instructions per byte. Operand layout with pair tables: K's byte j of a lane
// gives the pair (k = 2t, 2t+1) of chunk j/2 (register j % 2), i.e. the dot's k index is
// rotated-space coordinate 2·(t·D/8 + 2c + r) + e; V's two tokens of a register are merged
// nibble-wise into one index byte (two LOP3 per 4 bytes), tile mt's rows g and g+8 are the
// coordinates 2·(g·D/16 + mt) and 2·(g·D/16 + mt) + 1.

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

#define D HEAD_DIM
#define CB (D / 2)        // code bytes per token (4 bits)
#define KB (D / 8)        // K code bytes per lane per token
#define VB (D / 16)       // V code bytes per lane per token
#define NCH (D / 16)      // k16 chunks of Q·K == m16 tiles of P·V
#define KW (D / 32)       // K 32-bit words per lane per token
#define VW (D / 64)       // V 32-bit words per lane per token
#define KU (KB < 16 ? KB : 16)   // cp.async unit of K (bytes)
#define VU (VB < 16 ? VB : 16)   // cp.async unit of V (bytes)
#define NKU (KB / KU)
#define NVU (VB / VU)
// one warp's stage: K [2 tokens][NKU][32 lanes][KU], V [4 tokens][NVU][32 lanes][VU],
// norms [2 sides][16 tokens] bf16
#define K_STAGE (2 * KB * 32)
#define V_STAGE (4 * VB * 32)
#define STAGE_BYTES (K_STAGE + V_STAGE + 64)
#define RING_BYTES (WARPS * NST * STAGE_BYTES)
#ifndef EARLY
#define EARLY 0
#endif
#ifndef TEAMS
#define TEAMS 0
#endif
#define LOG2_WARPS (WARPS == 8 ? 3 : 2)
#define NT_MAX (TEAMS ? 2 : 1)   // KV heads a CTA may serve (one per team)
#define MERGE_BYTES ((WARPS * (GROUP * D + 24) + NT_MAX * GROUP * D) * 4)
// the query's float32 rows (QROT or K_SINK): NT_MAX·GROUP rows of D, then 8 score words per
// team; EARLY 1 gives them their own area right after the ring, so a CTA issues its first
// ring groups before the query prologue (else they share the ring's start). They are packed
// into registers before the main loop, so the merge area (written after it) may cover them.
#define Q_ROWS_BYTES ((NT_MAX * GROUP * D + 8 * NT_MAX) * 4)
#define Q_AREA ((QROT || K_SINK) && EARLY ? Q_ROWS_BYTES : 0)
#define SMEM_BYTES (RING_BYTES + Q_AREA > MERGE_BYTES ? RING_BYTES + Q_AREA : MERGE_BYTES)
#define NEG_INF (__int_as_float(0xff800000))
#ifndef LUT
#define LUT 0
#define TAB_BYTES 0
#define TAB_SAME 0
#define DYN_BYTES 0
#endif

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 s) {
  u32 d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(s));
  return d;
}

#if LUT
// one pair table: 256 entries × 32 replicas × 4 bytes (cuda_decode.TABLE_BYTES, checked)
#define ONE_TABLE (256 * 32 * 4)
static_assert(TAB_BYTES == ONE_TABLE * (TAB_SAME ? 1 : 2), "TAB_BYTES != the tables' size");
extern __shared__ __align__(16) u8 tab_smem[];

// the shared-memory address of byte K of code word w's entry for the lane whose replica
// address (the side's table, its row 0, the lane's bank) is lb: one byte permute (the entry,
// zero-extended) and one IMAD (rows of 128 bytes)
template <int K>
__device__ __forceinline__ u32 tab_addr(u32 w, u32 lb) {
  return prmt(w, 0u, 0x4440u | K) * 128u + lb;
}

__device__ __forceinline__ u32 tab_ld(u32 a) {
  u32 r;
  asm volatile("ld.shared.b32 %0, [%1];" : "=r"(r) : "r"(a));
  return r;
}

// the 16-bit centroid i of a side from its byte tables (low bytes t[0..3], high t[4..7])
__device__ __forceinline__ u32 centroid16(const u32* __restrict__ t, int i) {
  const u8* b = (const u8*)t;
  return (u32)b[i] | ((u32)b[16 + i] << 8);
}

// fill the pair tables (K's, then V's unless TAB_SAME): entry e = (centroid of e & 15) |
// (centroid of e >> 4) << 16 in 32 replicas (a 128-byte row); the whole CTA, 16-byte stores
__device__ __forceinline__ void fill_tables(const u32* __restrict__ k_tab,
                                            const u32* __restrict__ v_tab) {
  for (int i = threadIdx.x; i < TAB_BYTES / 16; i += WARPS * 32) {
    const int side = i / (ONE_TABLE / 16), e = (i / 8) % 256;
    const u32* tb = side ? v_tab : k_tab;
    const u32 val = centroid16(tb, e & 15) | (centroid16(tb, e >> 4) << 16);
    *(uint4*)(tab_smem + i * 16) = make_uint4(val, val, val, val);
  }
  __syncthreads();
}
#endif

// 4 code bytes (8 codes) -> 4 registers of two 16-bit centroids: o[0] = low-nibble codes of
// bytes 0, 1; o[1] = low nibbles of bytes 2, 3; o[2], o[3] = the high nibbles (element 0 in
// the low half). t[0..3]: the centroids' low-byte table, t[4..7]: their high bytes.
__device__ __forceinline__ void lut16(u32 c, const u32* t, u32* o) {
  u32 x = c & 0x77777777u;
  u32 s = ((c >> 1) & 0x44444444u) | 0x32103210u;
  u32 xs = x >> 16, ss = s >> 16;
  u32 l0 = prmt(prmt(t[0], t[1], x), prmt(t[2], t[3], x), s);
  u32 h0 = prmt(prmt(t[4], t[5], x), prmt(t[6], t[7], x), s);
  u32 l1 = prmt(prmt(t[0], t[1], xs), prmt(t[2], t[3], xs), ss);
  u32 h1 = prmt(prmt(t[4], t[5], xs), prmt(t[6], t[7], xs), ss);
  o[0] = prmt(l0, h0, 0x6240); o[1] = prmt(l1, h1, 0x6240);
  o[2] = prmt(l0, h0, 0x7351); o[3] = prmt(l1, h1, 0x7351);
}

// the same for an antisymmetric codebook (c[15 - i] = -c[i] bit for bit): the positive half's
// tables only (t[2], t[3] low bytes, t[6], t[7] high bytes of entries 8..15) and the sign
// from prmt's sign-replicate mode (loaders._prmt_sym16_asm).
__device__ __forceinline__ void sym16(u32 c, const u32* t, u32* o) {
  u32 m;
  asm("mul.hi.u32 %0, %1, 0xE0000000;" : "=r"(m) : "r"(c & 0x88888888u));
  u32 j = ~(c ^ m) & 0x77777777u;
  u32 jh = j >> 16;
  u32 la = prmt(t[2], t[3], j), lb = prmt(t[2], t[3], jh);
  u32 ha = prmt(t[6], t[7], j), hb = prmt(t[6], t[7], jh);
  u32 v = c << 4;
  ha |= ~prmt(v, c, 0xD9C8) & 0x80808080u;
  hb |= ~prmt(v, c, 0xFBEA) & 0x80808080u;
  o[0] = prmt(la, ha, 0x6240); o[1] = prmt(lb, hb, 0x6240);
  o[2] = prmt(la, ha, 0x7351); o[3] = prmt(lb, hb, 0x7351);
}

#if DOT_BF16
#define MMA_TYPE "bf16"
#else
#define MMA_TYPE "f16"
#endif

// d[0..3] += A[16][16] · B[16][8]: a0..a3 / b0, b1 in the mma.m16n8k16 fragment layout
__device__ __forceinline__ void mma(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32." MMA_TYPE "." MMA_TYPE ".f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ u32 pack2(float lo, float hi) {
  u32 r;
#if DOT_BF16
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#else
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#endif
  return r;
}

__device__ __forceinline__ u32 trans8x8(u32 x) {
  u32 r;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(r) : "r"(x));
  return r;
}

__device__ __forceinline__ float load_q(const void* q, long long i) {
#if Q_KIND == 0
  return ((const float*)q)[i];
#elif Q_KIND == 1
  return __uint_as_float((u32)((const u16*)q)[i] << 16);
#else
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(((const u16*)q)[i]));
  return f;
#endif
}

__device__ __forceinline__ float bf16_to_float(u32 bits) { return __uint_as_float(bits << 16); }

// N bytes (4, 8 or 16) of shared memory at byte address a into w[0 .. N/4)
template <int N>
__device__ __forceinline__ void lds(u32 a, u32* w) {
  if (N == 16)
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "r"(a));
  else if (N == 8)
    asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];" : "=r"(w[0]), "=r"(w[1]) : "r"(a));
  else
    asm volatile("ld.shared.b32 %0, [%1];" : "=r"(w[0]) : "r"(a));
}

template <int N>
__device__ __forceinline__ void cp_async(u32 dst, const void* src) {
  if (N == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(dst), "l"(src) : "memory");
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" :: "r"(dst), "l"(src), "n"(N)
                 : "memory");
}

__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_wait() {
  asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory");
}

// the 128-byte line at p into the L1 (a hint, no register; callers pass only addresses
// inside their buffers: PTX does not promise that a bad one is ignored)
__device__ __forceinline__ void prefetch_l1(const void* p) {
  asm volatile("prefetch.global.L1 [%0];" :: "l"(p));
}

// y = H x in place for `rows` rows of D floats in shared memory (H the unnormalized Sylvester
// Walsh–Hadamard matrix): log2(D) butterfly stages, the whole CTA, a barrier after each
__device__ __forceinline__ void fwht_rows(float* x, int rows) {
#pragma unroll 1
  for (int h = 1; h < D; h <<= 1) {
    for (int p = threadIdx.x; p < rows * D / 2; p += WARPS * 32) {
      const int row = p / (D / 2), r = p % (D / 2);
      const int i = row * D + (r / h) * 2 * h + (r % h);
      const float a = x[i], b = x[i + h];
      x[i] = a + b;
      x[i + h] = a - b;
    }
    __syncthreads();
  }
}

__device__ __forceinline__ void store_out(void* out, long long i, float v) {
#if OUT_KIND == 0
  ((float*)out)[i] = v;
#elif OUT_KIND == 1
  u16 r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(v));
  ((u16*)out)[i] = r;
#else
  u16 r;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(v));
  ((u16*)out)[i] = r;
#endif
}

// the online-softmax states of warps w0 .. w0 + nw - 1 (merge area: mo [WARPS][GROUP][D] rows,
// ml [WARPS][8] maxima, then [WARPS][8] weights, [WARPS][8] flagged-value masses) merged for
// head h, coordinate d: the row acc and the weight Lsum relative to the common maximum Ms (0
// when none is finite)
__device__ __forceinline__ void combine(const float* mo, const float* ml, int h, int d,
                                        float& acc, float& Lsum, float& F, float& Ms,
                                        int w0 = 0, int nw = WARPS) {
  float M = NEG_INF;
#pragma unroll
  for (int w = w0; w < w0 + nw; ++w) M = fmaxf(M, ml[w * 8 + h]);
  Ms = M == NEG_INF ? 0.f : M;
  Lsum = acc = F = 0.f;
#pragma unroll
  for (int w = w0; w < w0 + nw; ++w) {
    const float f = exp2f(ml[w * 8 + h] - Ms);
    Lsum += ml[WARPS * 8 + w * 8 + h] * f;
    F += ml[WARPS * 16 + w * 8 + h] * f;
    acc += mo[(w * GROUP + h) * D + d] * f;
  }
}

// one more normalized part row (value o, LSE ls in log2 units) folded into a running merge:
// max mx, weight den, weighted sum num (the result is num / den)
__device__ __forceinline__ void lse_fold(float& mx, float& den, float& num, float ls, float o) {
  const float mn = fmaxf(mx, ls);
  const float ms = mn == NEG_INF ? 0.f : mn;
  const float sc = exp2f(mx - ms), w = exp2f(ls - ms);
  den = den * sc + w;
  num = num * sc + o * w;
  mx = mn;
}

// element idx (head idx / D, coordinate idx % D) of a finished row set, value v: EPILOGUE 1
// writes it to out[o], EPILOGUE 2 keeps it in fin (shared) for the unrotation
__device__ __forceinline__ void final_row(void* out, float* fin, int idx, long long o, float v) {
#if EPILOGUE == 2
  fin[idx] = v;
#else
  store_out(out, o, v);
#endif
}

#ifndef BALANCED
#define BALANCED 0
#endif
#ifndef MERGE_SPLITS
#define MERGE_SPLITS 0
#endif
static_assert(!MERGE_SPLITS || (EPILOGUE != 0 && !BALANCED),
              "the in-kernel merge of splits writes the output (EPILOGUE 1 or 2), split schedule");
#ifndef PROBE
#define PROBE 0
#endif
#define PROBE_WORDS 8
static_assert(!PROBE || !BALANCED, "the timeline probe is the split schedule's");
#if PROBE
__device__ __forceinline__ unsigned long long probe_now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
#define PROBE_AT(k) do { if (threadIdx.x == 0) probe_row[k] = probe_now(); } while (0)
#else
#define PROBE_AT(k) do { } while (0)
#endif
static_assert(!BALANCED || EPILOGUE != 0, "the balanced schedule writes the output itself");
static_assert(!TEAMS || (WARPS == 8 && !BALANCED), "teams need 8 warps and the split schedule");
static_assert(EARLY || (QROT == 0 && K_SINK == 0) ||
              (RING_BYTES > MERGE_BYTES ? RING_BYTES : MERGE_BYTES) >= Q_ROWS_BYTES,
              "the query rows do not fit the ring's area");

// sequence i's attended tokens: its length L, the window's first token `start`, the block
// table's capacity applied (`lim`), and its 16-token steps [s0, s1)
struct Span {
  int L, start, lim, s0, s1;
};

__device__ __forceinline__ Span span_of(const int* __restrict__ seq_lens, int i, int window,
                                        long long cap) {
  Span s;
  s.L = seq_lens[i];
  s.start = window > 0 ? max(s.L - window, 0) : 0;
  s.lim = (int)min((long long)s.L, cap);
  s.s0 = s.start / 16;
  s.s1 = (s.lim + 15) / 16;
  return s;
}

// the 16-token steps of each of a sequence's `splits` splits (the last may hold fewer)
__device__ __forceinline__ int steps_per_split(const Span& s, int splits) {
  return (max(s.s1 - s.s0, 0) + splits - 1) / splits;
}

#if BALANCED
// the 16-token steps of sequence i (its window and the block table's capacity applied)
__device__ __forceinline__ int steps_of(const int* __restrict__ seq_lens, int i, int window,
                                        long long cap) {
  const Span s = span_of(seq_lens, i, window, cap);
  return max(s.s1 - s.s0, 0);
}

// the CTA's inclusive prefix sum of v over its threads (WARPS warps); red: WARPS + 1 longs of
// shared memory, the block total left in red[WARPS]
__device__ __forceinline__ long long block_scan(long long v, long long* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const long long u = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += u;
  }
  if (lane == 31) red[warp] = v;
  __syncthreads();
  long long before = 0, total = 0;
#pragma unroll
  for (int w = 0; w < WARPS; ++w) {
    before += w < warp ? red[w] : 0;
    total += red[w];
  }
  __syncthreads();
  if (threadIdx.x == 0) red[WARPS] = total;
  return v + before;
}

// the CTA whose step range holds step x (CTA c owns [c·T / C, (c + 1)·T / C))
__device__ __forceinline__ int cta_of(long long x, long long T, int C) {
  return (int)(((x + 1) * C - 1) / T);
}
#endif

extern "C" __global__ void __launch_bounds__(WARPS * 32, MIN_CTAS) tkv_decode_k4v4(
    const void* __restrict__ q, int sq_s, int sq_h,
    const int* __restrict__ block_table, int s_bt, const int* __restrict__ seq_lens,
    int max_blocks, int num_blocks,
    const u8* __restrict__ cache, int page_bytes,
    int k_codes_off, int k_head_stride, int k_norms_off,
    int v_codes_off, int v_head_stride, int v_norms_off, int norm_head_stride,
    const u32* __restrict__ k_tab, const u32* __restrict__ v_tab,
    float* __restrict__ part_o, float* __restrict__ part_lse,
    double scale_log2_d, int window, int num_splits,
    const float* __restrict__ q_w, void* __restrict__ out, int so_s, int so_h,
    const float* __restrict__ o_w, const float* __restrict__ k_shift,
    const float* __restrict__ v_shift, int num_seqs, int hkv, int* __restrict__ counters,
    int min_steps, int team_steps) {
#if LUT   // all dynamic: the tables, then the ring / merge area
  static_assert(DYN_BYTES >= TAB_BYTES + SMEM_BYTES, "DYN_BYTES too small for tables + ring");
  u8* const smem = tab_smem + TAB_BYTES;
#else
  __shared__ __align__(16) u8 smem[SMEM_BYTES];
#endif
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const float scale_log2 = (float)scale_log2_d;
  const long long cap = (long long)max_blocks * BLOCK_SIZE;
#if PROBE
  // after the (num_seqs · hkv) int32 counters of MERGE_SPLITS, rounded up to whole u64 words
  unsigned long long* const probe_row = (unsigned long long*)counters + (num_seqs * hkv + 1) / 2
      + PROBE_WORDS *
      (blockIdx.x + (long long)gridDim.x * (blockIdx.y + (long long)gridDim.y * blockIdx.z));
  PROBE_AT(0);
  if (threadIdx.x == 0) {
    u32 sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    probe_row[PROBE_WORDS - 1] = sm;
  }
#endif
#if EARLY && !BALANCED
  // every small global read of the prologue and the epilogue requested at once, before the
  // first of them is waited for: the length, the byte tables, the query rows of the heads the
  // CTA may serve, the rotation's weights (then L1 hits instead of one DRAM round trip each)
  {
    const int tid = threadIdx.x;
    constexpr int QB = Q_KIND == 0 ? 4 : 2, LINES = (D * QB + 127) / 128;
    if (tid == 0) prefetch_l1(seq_lens + blockIdx.x);
#if LUT
    if (tid == 1) prefetch_l1(k_tab);
    if (tid == 2) prefetch_l1(v_tab);
#endif
    for (int i = tid; i < NT_MAX * GROUP * LINES; i += WARPS * 32) {
      const int r = i / LINES, h = blockIdx.y * GROUP + r;
      if (h < hkv * GROUP)
        prefetch_l1((const u8*)q + ((long long)blockIdx.x * sq_s + (long long)h * sq_h) * QB +
                    (i % LINES) * 128);
    }
#if QROT
    if (tid >= 32 && tid < 32 + D / 32) prefetch_l1(q_w + (tid - 32) * 32);
#endif
  }
#endif
#if TEAMS   // two teams of 4 warps, one per KV head, when the split is short (see the header)
  int nt = 1;
  if (team_steps > 0 && hkv > 1 && steps_per_split(span_of(seq_lens, blockIdx.x, window, cap),
                                                   num_splits) <= team_steps) {
    if (blockIdx.y & 1) {   // head 2k + 1 is served by the CTA of head 2k
      PROBE_AT(6);   // words 1-5 stay as the host left them
      return;
    }
    nt = 2;
  }
  const int lgw = nt == 2 ? LOG2_WARPS - 1 : LOG2_WARPS;
  const int tw = 1 << lgw, team = warp >> lgw, wt = warp & (tw - 1);   // team size, team, rank
#else   // one team of WARPS warps: compile-time constants, the code of a build without teams
  constexpr int nt = 1, lgw = LOG2_WARPS, tw = WARPS, team = 0;
  const int wt = warp;
#endif

  // the byte tables, resident in regular registers
#if LUT
#if BALANCED || !EARLY
  fill_tables(k_tab, v_tab);
#endif
  const u32 lbk = (u32)__cvta_generic_to_shared(tab_smem) + lane * 4;
  const u32 lbv = lbk + (TAB_SAME ? 0 : ONE_TABLE);
#else
  u32 kt[8], vt[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) { kt[i] = k_tab[i]; vt[i] = v_tab[i]; }
#endif

#if BALANCED
  // Balanced (stream-K) schedule: the batch's (sequence, KV head) pairs laid end to end as
  // one run of T 16-token steps, pair p = (i, h) at [hkv·S_i + h·n_i, + n_i) with n_i the
  // sequence's steps and S_i = n_0 + … + n_(i-1); CTA c takes steps [c·T / C, (c + 1)·T / C)
  // of the run, C = min(gridDim.x, ⌈T / min_steps⌉) — a segment of each pair it touches. A
  // pair inside one CTA is written by it; a pair cut across CTAs c0..c1 leaves each part's
  // normalized row and LSE in part_o / part_lse (slot 2c + (pair starts at or before the
  // CTA's first step ? 0 : 1)), and the CTA that finishes its part last (counters[p], reset
  // by it) merges them and writes the output.
  __shared__ long long red[WARPS + 3];
  long long T = 0;
  for (int i0 = 0; i0 < num_seqs; i0 += WARPS * 32) {
    const int i = i0 + threadIdx.x;
    block_scan(i < num_seqs ? steps_of(seq_lens, i, window, cap) : 0, red);
    __syncthreads();
    T += red[WARPS] * hkv;
    __syncthreads();
  }
  const int ms = max(min_steps, 1);
  const int C = T > 0 ? (int)min((long long)gridDim.x, (T + ms - 1) / ms) : 0;
  const int me = blockIdx.x;
  const long long a = me < C ? me * T / C : 0, b = me < C ? (me + 1) * T / C : 0;
  // the sequence holding step a: seq, its steps n and its first pair's first step P0
  int seq = 0, n = 0;
  long long P0 = 0;
  if (a < b) {
    long long S = 0;   // hkv · (the steps of the sequences before chunk i0)
    for (int i0 = 0; i0 < num_seqs; i0 += WARPS * 32) {
      const int i = i0 + threadIdx.x;
      const int ni = i < num_seqs ? steps_of(seq_lens, i, window, cap) : 0;
      const long long incl = S + hkv * block_scan(ni, red);
      if (ni > 0 && incl - (long long)hkv * ni <= a && a < incl) {
        red[WARPS + 1] = i;
        red[WARPS + 2] = incl - (long long)hkv * ni;
      }
      __syncthreads();
      const long long chunk = red[WARPS] * hkv;
      __syncthreads();
      if (a < S + chunk) break;
      S += chunk;
    }
    seq = (int)red[WARPS + 1];
    P0 = red[WARPS + 2];
    n = steps_of(seq_lens, seq, window, cap);
  }
  int kvh = n > 0 ? (int)((a - P0) / n) : 0;
  long long P = P0 + (long long)kvh * n;   // the current pair's first step
  long long x = a;
  while (x < b) {
    const long long seg_end = min(b, P + n);
#else
  // the CTA's first KV head, the warp's (its team's) KV head
  const int seq = blockIdx.x, kvh0 = blockIdx.y, kvh = kvh0 + team, split = blockIdx.z;
  {
#endif
  const Span sp = span_of(seq_lens, seq, window, cap);
#if BALANCED
  const int kvh0 = kvh;
#endif
  const int L = sp.L, start = sp.start, lim = sp.lim, s0 = sp.s0, s1 = sp.s1;
#if TEAMS
  const bool live = kvh < hkv;   // false only for team 1 past the last head (hkv odd)
#else
  constexpr bool live = true;
#endif
#if BALANCED
  const int my0 = s0 + (int)(x - P);
  const int my1 = s0 + (int)(seg_end - P);
#else
  const int per = steps_per_split(sp, num_splits);
  const int my0 = s0 + split * per;
  const int my1 = min(my0 + per, s1);
#endif
  // this warp's 16-token steps: my0 + wt + tw·j, j < n_i
  const int n_i = live && my1 > my0 + wt ? (my1 - my0 - wt + tw - 1) >> lgw : 0;
  const int* bt_row = block_table + (long long)seq * s_bt;

  // the query as the B operand of S^T = K · q^T, in the relabelled k order: chunk c,
  // register r (0: k = 2t, 2t+1; 1: k = 2t+8, 2t+9), element e is rotated-space coordinate
  // 2·(t·KB + 4·(c/2) + 2r + e) + (c % 2)
  u32 qb[NCH][2];
  float qd0 = 0.f, qd1 = 0.f;   // K_SINK: scale_log2 · <q, c_k> of heads 2t, 2t+1
  auto load_query = [&]() {
    const long long qrow = (long long)seq * sq_s + (long long)(kvh * GROUP) * sq_h;
#if QROT || K_SINK
    // the query rows in shared memory (float32): model-space rows rotated here as
    // H (q_w ⊙ q) (QROT), and the flagged keys' score term from them (K_SINK)
    // rows [nt][GROUP][D] (team tm's rows: KV head kvh0 + tm), then [nt][8] score words
    float* qs = (float*)(smem + (EARLY ? RING_BYTES : 0));   // EARLY: after the ring
    // (team 1's heads follow team 0's: row i / D of the CTA's first head's query rows)
    const long long qrow0 = (long long)seq * sq_s + (long long)(kvh0 * GROUP) * sq_h;
    for (int i = threadIdx.x; i < nt * GROUP * D; i += WARPS * 32) {
      float x = 0.f;
      if (!TEAMS || kvh0 + i / (GROUP * D) < hkv) {
        x = load_q(q, qrow0 + (long long)(i / D) * sq_h + i % D);
#if QROT
        x *= q_w[i % D];
#endif
      }
      qs[i] = x;
    }
    __syncthreads();
#if QROT
    fwht_rows(qs, nt * GROUP);
#endif
    const float* qt = qs + team * GROUP * D;   // the warp's team's rows
#if K_SINK
    float* qd = qs + nt * GROUP * D + team * 8;
    if (wt == 0 && live) {
      for (int h = 0; h < GROUP; ++h) {
        float a = 0.f;
        for (int d = lane; d < D; d += 32) a += qt[h * D + d] * k_shift[(long long)kvh * D + d];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o);
        if (lane == 0) qd[h] = a * scale_log2;
      }
    }
    __syncthreads();
    if (2 * t < GROUP) qd0 = qd[2 * t];
    if (2 * t + 1 < GROUP) qd1 = qd[2 * t + 1];
#endif
#endif
#pragma unroll
    for (int c = 0; c < NCH; ++c)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float e0 = 0.f, e1 = 0.f;
        if (g < GROUP && live) {
#if LUT   // element e: coordinate 2·(t·KB + 2c + r) + e
          const int base = 2 * (t * KB + 2 * c + r), step = 1;
#else
          const int base = 2 * (t * KB + 4 * (c >> 1) + 2 * r) + (c & 1), step = 2;
#endif
#if QROT || K_SINK
          e0 = qt[g * D + base];
          e1 = qt[g * D + base + step];
#else
          e0 = load_q(q, qrow + (long long)g * sq_h + base);
          e1 = load_q(q, qrow + (long long)g * sq_h + base + step);
#endif
        }
        qb[c][r] = pack2(e0, e1);
      }
#if (QROT || K_SINK) && !EARLY
    __syncthreads();   // the ring below reuses the rows' shared memory
#endif
  };
#if !EARLY
  load_query();
#endif

  const u32 ring = (u32)__cvta_generic_to_shared(smem) + warp * NST * STAGE_BYTES;
  const u8* kv_head_k = cache + k_codes_off + (long long)kvh * k_head_stride;
  const u8* kv_head_v = cache + v_codes_off + (long long)kvh * v_head_stride;
  const long long norm_k = k_norms_off + 2LL * kvh * norm_head_stride;
  const long long norm_v = v_norms_off + 2LL * kvh * norm_head_stride;

  // issue step j's copies into its stage (blk: its page, read one step ahead); returns
  // whether the page is valid
  auto issue = [&](int j, int blk) -> bool {
    if (blk < 0 || blk >= num_blocks) return false;
    const int pos0 = (my0 + wt + (j << lgw)) * 16;
    const long long page = (long long)blk * page_bytes;
    const int tok0 = pos0 % BLOCK_SIZE;
    const u32 st = ring + (j % NST) * STAGE_BYTES;
    const u8* kp = kv_head_k + page + (long long)(tok0 + g) * CB + t * KB;
#pragma unroll
    for (int tk = 0; tk < 2; ++tk)
#pragma unroll
      for (int u = 0; u < NKU; ++u)
        cp_async<KU>(st + ((tk * NKU + u) * 32 + lane) * KU, kp + tk * 8 * CB + u * KU);
    const u8* vp = kv_head_v + page + (long long)(tok0 + 2 * t) * CB + g * VB;
#pragma unroll
    for (int tv = 0; tv < 4; ++tv)
#pragma unroll
      for (int u = 0; u < NVU; ++u)
        cp_async<VU>(st + K_STAGE + ((tv * NVU + u) * 32 + lane) * VU,
                     vp + ((tv & 1) + 8 * (tv >> 1)) * CB + u * VU);
    if (lane < 16) {
      const long long nb = lane < 8 ? norm_k : norm_v;
      cp_async<4>(st + K_STAGE + V_STAGE + lane * 4,
                  cache + page + nb + 2LL * (tok0 + 2 * (lane & 7)));
    }
    return true;
  };
  // the block-table entry of step j (read one step before its copies are issued)
  auto block_of = [&](int j) -> int {
    return j < n_i ? bt_row[(my0 + wt + (j << lgw)) * 16 / BLOCK_SIZE] : -1;
  };

  float O[NCH][4];
#pragma unroll
  for (int i = 0; i < NCH; ++i) O[i][0] = O[i][1] = O[i][2] = O[i][3] = 0.f;
  float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;   // heads 2t, 2t+1
  float f0 = 0.f, f1 = 0.f;   // V_SINK: the flagged values' softmax mass (rescaled like l)
  u32 okbits = 0;
#if EARLY && !BALANCED
  // the block-table entries of the CTA's first ring groups (every warp's): one or two lines
  {
    const int e0 = my0 * 16 / BLOCK_SIZE, e1 = min((my1 - 1) * 16 / BLOCK_SIZE, max_blocks - 1);
    const int e = e0 + (int)threadIdx.x * 32;   // 32 entries (128 bytes) per thread
    if (my1 > my0 && threadIdx.x < 2 && e <= e1) prefetch_l1(bt_row + e);
  }
#endif
  int nblk = block_of(0);
  // the ring: NST = SUB·(NPF + 1) stages; an iteration consumes SUB steps (one commit
  // group) while the NPF groups after it are in flight
  constexpr int NPF = NST / SUB - 1;
  auto issue_group = [&](int first) {
#pragma unroll
    for (int k = 0; k < SUB; ++k) {
      const int j = first + k;
      const u32 bit = 1u << (j % NST);
      const int blk = nblk;
      nblk = block_of(j + 1);
      okbits &= ~bit;
      if (j < n_i && issue(j, blk)) okbits |= bit;
    }
    cp_commit();
  };
#pragma unroll
  for (int p = 0; p < NPF; ++p) issue_group(p * SUB);
#if EARLY   // the prologue while the first groups are in flight
#if LUT && !BALANCED
  fill_tables(k_tab, v_tab);
#endif
  load_query();
#endif

  const int n_it = (n_i + SUB - 1) / SUB;
  PROBE_AT(1);
#if PROBE
  if (threadIdx.x == 0) probe_row[PROBE_WORDS - 1] |= (unsigned long long)n_i << 32;
#endif
  for (int it = 0; it < n_it; ++it) {
    __syncwarp();   // every lane is done reading the stages the next issue overwrites
    issue_group((it + NPF) * SUB);
    cp_wait<NPF>();
    __syncwarp();   // the norm words copied by lanes 0..15 are visible to all lanes
#if PROBE
    if (it == 0) PROBE_AT(2);
    if (it == 8) PROBE_AT(3);
#endif

    float x[SUB][4], fv[SUB][2];
    bool vm[SUB][2], vf[SUB][2];
    float mx0 = NEG_INF, mx1 = NEG_INF;
#pragma unroll
    for (int k = 0; k < SUB; ++k) {
      const int j = it * SUB + k;
      const u32 st = ring + (j % NST) * STAGE_BYTES;
      const bool ok = (okbits >> (j % NST)) & 1;   // false past n_i too (never issued)
      const int pos0 = (my0 + wt + (j << lgw)) * 16;
      vm[k][0] = ok && pos0 + g >= start && pos0 + g < lim;
      vm[k][1] = ok && pos0 + g + 8 >= start && pos0 + g + 8 < lim;
      // S^T = K · q^T (two accumulators: half the dependent HMMA chain)
      float sa[4] = {0.f, 0.f, 0.f, 0.f}, sb[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int u = 0; u < NKU; ++u) {
        u32 ka[KU / 4], kb[KU / 4];
        lds<KU>(st + (u * 32 + lane) * KU, ka);
        lds<KU>(st + ((NKU + u) * 32 + lane) * KU, kb);
#pragma unroll
        for (int w = 0; w < KU / 4; ++w) {
          const int c = 2 * (u * (KU / 4) + w);
#if LUT   // byte k of the word: chunk c + k/2, register k % 2
          const u32 a0 = tab_ld(tab_addr<0>(ka[w], lbk)), b0 = tab_ld(tab_addr<0>(kb[w], lbk));
          const u32 a1 = tab_ld(tab_addr<1>(ka[w], lbk)), b1 = tab_ld(tab_addr<1>(kb[w], lbk));
          const u32 a2 = tab_ld(tab_addr<2>(ka[w], lbk)), b2 = tab_ld(tab_addr<2>(kb[w], lbk));
          const u32 a3 = tab_ld(tab_addr<3>(ka[w], lbk)), b3 = tab_ld(tab_addr<3>(kb[w], lbk));
          mma(sa, a0, b0, a1, b1, qb[c][0], qb[c][1]);
          mma(sb, a2, b2, a3, b3, qb[c + 1][0], qb[c + 1][1]);
#else
          u32 oa[4], ob[4];
#if K_SYM
          sym16(ka[w], kt, oa); sym16(kb[w], kt, ob);
#else
          lut16(ka[w], kt, oa); lut16(kb[w], kt, ob);
#endif
          mma(sa, oa[0], ob[0], oa[1], ob[1], qb[c][0], qb[c][1]);
          mma(sb, oa[2], ob[2], oa[3], ob[3], qb[c + 1][0], qb[c + 1][1]);
#endif
        }
      }
      // norms: K then V, tokens g and g+8
      const u32 pn = st + K_STAGE + V_STAGE;
      u16 n0, n1, n2, n3;
      asm volatile("ld.shared.u16 %0, [%1];" : "=h"(n0) : "r"(pn + 2 * g));
      asm volatile("ld.shared.u16 %0, [%1];" : "=h"(n1) : "r"(pn + 2 * (g + 8)));
      asm volatile("ld.shared.u16 %0, [%1];" : "=h"(n2) : "r"(pn + 32 + 2 * g));
      asm volatile("ld.shared.u16 %0, [%1];" : "=h"(n3) : "r"(pn + 32 + 2 * (g + 8)));
#if K_SINK   // the sign bit flags a sink-coded key: |n| scales it, <q, c_k> is added
      const float sg = bf16_to_float(n0 & 0x7fffu) * scale_log2;
      const float sg8 = bf16_to_float(n1 & 0x7fffu) * scale_log2;
      const bool fk = n0 >> 15, fk8 = n1 >> 15;
      x[k][0] = vm[k][0] ? (sa[0] + sb[0]) * sg + (fk ? qd0 : 0.f) : NEG_INF;
      x[k][1] = vm[k][0] ? (sa[1] + sb[1]) * sg + (fk ? qd1 : 0.f) : NEG_INF;
      x[k][2] = vm[k][1] ? (sa[2] + sb[2]) * sg8 + (fk8 ? qd0 : 0.f) : NEG_INF;
      x[k][3] = vm[k][1] ? (sa[3] + sb[3]) * sg8 + (fk8 ? qd1 : 0.f) : NEG_INF;
#else
      const float sg = bf16_to_float(n0) * scale_log2, sg8 = bf16_to_float(n1) * scale_log2;
      x[k][0] = vm[k][0] ? (sa[0] + sb[0]) * sg : NEG_INF;
      x[k][1] = vm[k][0] ? (sa[1] + sb[1]) * sg : NEG_INF;
      x[k][2] = vm[k][1] ? (sa[2] + sb[2]) * sg8 : NEG_INF;
      x[k][3] = vm[k][1] ? (sa[3] + sb[3]) * sg8 : NEG_INF;
#endif
#if V_SINK
      fv[k][0] = bf16_to_float(n2 & 0x7fffu);
      fv[k][1] = bf16_to_float(n3 & 0x7fffu);
      vf[k][0] = n2 >> 15;
      vf[k][1] = n3 >> 15;
#else
      fv[k][0] = bf16_to_float(n2);
      fv[k][1] = bf16_to_float(n3);
      vf[k][0] = vf[k][1] = false;
#endif
      mx0 = fmaxf(mx0, fmaxf(x[k][0], x[k][2]));
      mx1 = fmaxf(mx1, fmaxf(x[k][1], x[k][3]));
    }
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) {
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, o));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, o));
    }
    const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
    const float ms0 = mn0 == NEG_INF ? 0.f : mn0, ms1 = mn1 == NEG_INF ? 0.f : mn1;
    const float al0 = exp2f(m0 - ms0), al1 = exp2f(m1 - ms1);
    m0 = mn0; m1 = mn1;
    l0 *= al0; l1 *= al1;
#if V_SINK
    f0 *= al0; f1 *= al1;
#endif
    u32 pb[SUB][2];
#pragma unroll
    for (int k = 0; k < SUB; ++k) {
      const float p0 = exp2f(x[k][0] - ms0), p1 = exp2f(x[k][1] - ms1);
      const float p2 = exp2f(x[k][2] - ms0), p3 = exp2f(x[k][3] - ms1);
      l0 += p0 + p2;
      l1 += p1 + p3;
#if V_SINK
      f0 += (vf[k][0] ? p0 : 0.f) + (vf[k][1] ? p2 : 0.f);
      f1 += (vf[k][0] ? p1 : 0.f) + (vf[k][1] ? p3 : 0.f);
#endif
      // P^T (tokens × heads, V norms applied) → the B operand: one transpose per 8 tokens
      pb[k][0] = trans8x8(pack2(vm[k][0] ? p0 * fv[k][0] : 0.f, vm[k][0] ? p1 * fv[k][0] : 0.f));
      pb[k][1] = trans8x8(pack2(vm[k][1] ? p2 * fv[k][1] : 0.f, vm[k][1] ? p3 * fv[k][1] : 0.f));
    }
    if (__any_sync(0xffffffffu, al0 != 1.f || al1 != 1.f)) {
#pragma unroll
      for (int mt = 0; mt < NCH; ++mt) {
        O[mt][0] *= al0; O[mt][1] *= al1; O[mt][2] *= al0; O[mt][3] *= al1;
      }
    }
    // O^T += V^T · P^T
#pragma unroll
    for (int k = 0; k < SUB; ++k) {
      const u32 st = ring + ((it * SUB + k) % NST) * STAGE_BYTES;
#pragma unroll
      for (int u = 0; u < NVU; ++u) {
        u32 vv[4][VU / 4];
#pragma unroll
        for (int tv = 0; tv < 4; ++tv)
          lds<VU>(st + K_STAGE + ((tv * NVU + u) * 32 + lane) * VU, vv[tv]);
#pragma unroll
        for (int w = 0; w < VU / 4; ++w) {
          const int v = u * (VU / 4) + w;   // the lane's word index within its VB bytes
#if LUT   // index bytes: (low nibbles | high nibbles) of tokens (2t, 2t+1), (2t+8, 2t+9)
          const u32 lo01 = (vv[0][w] & 0x0f0f0f0fu) | ((vv[1][w] << 4) & 0xf0f0f0f0u);
          const u32 hi01 = (__umulhi(vv[0][w], 1u << 28) & 0x0f0f0f0fu) | (vv[1][w] & 0xf0f0f0f0u);
          const u32 lo23 = (vv[2][w] & 0x0f0f0f0fu) | ((vv[3][w] << 4) & 0xf0f0f0f0u);
          const u32 hi23 = (__umulhi(vv[2][w], 1u << 28) & 0x0f0f0f0fu) | (vv[3][w] & 0xf0f0f0f0u);
#define TKV_VTILE(K)                                                                  \
          mma(O[4 * v + K], tab_ld(tab_addr<K>(lo01, lbv)), tab_ld(tab_addr<K>(hi01, lbv)), \
              tab_ld(tab_addr<K>(lo23, lbv)), tab_ld(tab_addr<K>(hi23, lbv)), pb[k][0], pb[k][1]);
          TKV_VTILE(0) TKV_VTILE(1) TKV_VTILE(2) TKV_VTILE(3)
#undef TKV_VTILE
#else
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const u32 sel = h ? 0x7362u : 0x5140u;
            u32 o01[4], o23[4];
#if V_SYM
            sym16(prmt(vv[0][w], vv[1][w], sel), vt, o01);
            sym16(prmt(vv[2][w], vv[3][w], sel), vt, o23);
#else
            lut16(prmt(vv[0][w], vv[1][w], sel), vt, o01);
            lut16(prmt(vv[2][w], vv[3][w], sel), vt, o23);
#endif
#pragma unroll
            for (int kk = 0; kk < 2; ++kk)
              mma(O[4 * v + 2 * h + kk], o01[2 * kk], o01[2 * kk + 1], o23[2 * kk],
                  o23[2 * kk + 1], pb[k][0], pb[k][1]);
          }
#endif
        }
      }
    }
  }
  cp_wait<0>();
  PROBE_AT(4);
#if EPILOGUE == 2 && EARLY && !BALANCED
  // the unrotation's weights, requested before the merge so their latency hides under it
  constexpr int OWN = D > WARPS * 32 ? D / (WARPS * 32) : 1;
  float ow[OWN];
#pragma unroll
  for (int k = 0; k < OWN; ++k) ow[k] = o_w[((int)threadIdx.x + k * WARPS * 32) % D];
#endif

  // merge the warps: each writes (m, l) per head and its O^T rows to shared memory
#pragma unroll
  for (int o = 4; o < 32; o <<= 1) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, o);
    l1 += __shfl_xor_sync(0xffffffffu, l1, o);
#if V_SINK
    f0 += __shfl_xor_sync(0xffffffffu, f0, o);
    f1 += __shfl_xor_sync(0xffffffffu, f1, o);
#endif
  }
  __syncthreads();
  PROBE_AT(5);
  float* mo = (float*)smem;                       // [WARPS][GROUP][D]
  float* ml = mo + WARPS * GROUP * D;   // [WARPS][8] m, then [WARPS][8] l, [WARPS][8] f
  float* fin = ml + WARPS * 24;         // [nt][GROUP][D] the merged rows (EPILOGUE 2)
  if (g == 0) {
    ml[warp * 8 + 2 * t] = m0; ml[warp * 8 + 2 * t + 1] = m1;
    ml[WARPS * 8 + warp * 8 + 2 * t] = l0; ml[WARPS * 8 + warp * 8 + 2 * t + 1] = l1;
    ml[WARPS * 16 + warp * 8 + 2 * t] = f0; ml[WARPS * 16 + warp * 8 + 2 * t + 1] = f1;
  }
#pragma unroll
  for (int mt = 0; mt < NCH; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      // row g (r = 0) / g+8 (r = 1) of tile mt is coordinate
      // 2·(g·VB + 4·(mt/4) + 2·((mt/2) % 2) + r) + mt % 2
#if LUT
      const int coord = 2 * (g * VB + mt) + r;
#else
      const int coord = 2 * (g * VB + 4 * (mt >> 2) + 2 * ((mt >> 1) & 1) + r) + (mt & 1);
#endif
      if (2 * t < GROUP) mo[(warp * GROUP + 2 * t) * D + coord] = O[mt][2 * r];
      if (2 * t + 1 < GROUP) mo[(warp * GROUP + 2 * t + 1) * D + coord] = O[mt][2 * r + 1];
    }
  __syncthreads();
#if BALANCED
  // this CTA's part of pair p: the whole pair (written here), or one of parts c0..c1
  const int c0 = cta_of(P, T, C), c1 = cta_of(P + n - 1, T, C);
  const bool whole = c0 == c1;
  const int slot = 2 * me + (P <= a ? 0 : 1);
#endif
  for (int idx = threadIdx.x; idx < nt * GROUP * D; idx += WARPS * 32) {
    const int tm = TEAMS ? idx / (GROUP * D) : 0, hk = kvh0 + tm;   // its team and KV head
    if (TEAMS && hk >= hkv) continue;
    const int h = (idx / D) % GROUP, d = idx % D;
    float acc, Lsum, F, Ms;
    combine(mo, ml, h, d, acc, Lsum, F, Ms, tm << lgw, tw);
#if V_SINK
    acc += F * v_shift[(long long)hk * D + d];   // c_v times the flagged softmax mass
#endif
    float inv = 1.f / (Lsum > 0.f ? Lsum : 1.f);
    if (cap < L) inv = __int_as_float(0x7fc00000);   // a length past the block table: NaN rows
#if EPILOGUE == 0 || MERGE_SPLITS
    const long long row = ((long long)seq * (GROUP * hkv) + hk * GROUP + h) * num_splits + split;
    part_o[row * D + d] = acc * inv;
    if (d == 0) part_lse[row] = Lsum > 0.f ? Ms + log2f(Lsum) : NEG_INF;
#else
#if BALANCED
    if (!whole) {   // this part's normalized row and LSE
      part_o[(slot * GROUP + h) * D + d] = acc * inv;
      if (d == 0) part_lse[slot * GROUP + h] = Lsum > 0.f ? Ms + log2f(Lsum) : NEG_INF;
      continue;
    }
#endif
    final_row(out, fin, idx, (long long)seq * so_s + (long long)(hk * GROUP + h) * so_h + d,
              acc * inv);
#endif
  }
#if BALANCED
  if (!whole) {   // the last part to finish merges the parts (their LSEs) and writes the row
    __threadfence();
    __syncthreads();
    const int p = seq * hkv + kvh;
    if (threadIdx.x == 0) red[WARPS + 1] = atomicAdd(&counters[p], 1) == c1 - c0;
    __syncthreads();
    if (red[WARPS + 1]) {
      __threadfence();
      const int first = 2 * c0 + (P <= c0 * T / C ? 0 : 1);
      // warp w folds parts c0 + w, c0 + w + WARPS, … into an online-softmax state per element
      // (lane + 32 j: its head's running max and weight, the weighted row), 8 elements at a
      // time; the warps' states then merge through the merge area as a segment's do
#pragma unroll 1
      for (int j0 = 0; j0 < GROUP * D / 32; j0 += 8) {
        float mx[8], den[8], num[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) { mx[j] = NEG_INF; den[j] = num[j] = 0.f; }
#pragma unroll 2
        for (int c = c0 + warp; c <= c1; c += WARPS) {
          const int sl = c == c0 ? first : 2 * c;
          float ls[8], o[8];
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            const int idx = lane + 32 * (j0 + j);
            ls[j] = idx < GROUP * D ? __ldcg(part_lse + sl * GROUP + idx / D) : NEG_INF;
            o[j] = idx < GROUP * D ? __ldcg(part_o + (long long)sl * GROUP * D + idx) : 0.f;
          }
#pragma unroll
          for (int j = 0; j < 8; ++j) {   // lse_fold's arithmetic, inline: the balanced build
            // with the call compiles differently and has not run on a GPU that way yet
            const float mn = fmaxf(mx[j], ls[j]);
            const float ms = mn == NEG_INF ? 0.f : mn;
            const float sc = exp2f(mx[j] - ms), w = exp2f(ls[j] - ms);
            den[j] = den[j] * sc + w;
            num[j] = num[j] * sc + o[j] * w;
            mx[j] = mn;
          }
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const int idx = lane + 32 * (j0 + j);
          if (idx >= GROUP * D) continue;
          mo[warp * GROUP * D + idx] = num[j];
          if (idx % D == 0) {   // the head's first element: its max and weight
            ml[warp * 8 + idx / D] = mx[j];
            ml[WARPS * 8 + warp * 8 + idx / D] = den[j];
            ml[WARPS * 16 + warp * 8 + idx / D] = 0.f;
          }
        }
      }
      __syncthreads();
      for (int idx = threadIdx.x; idx < GROUP * D; idx += WARPS * 32) {
        float acc, Lsum, F, Ms;
        combine(mo, ml, idx / D, idx % D, acc, Lsum, F, Ms);
        float v = acc / (Lsum > 0.f ? Lsum : 1.f);
        if (cap < L) v = __int_as_float(0x7fc00000);
        final_row(out, fin, idx,
                  (long long)seq * so_s + (long long)(kvh * GROUP + idx / D) * so_h + idx % D, v);
      }
      if (threadIdx.x == 0) counters[p] = 0;   // ready for the next launch (CUDA graphs)
    }
  }
  const bool wrote = whole || red[WARPS + 1];
#elif MERGE_SPLITS
  // the split of this (sequence, KV head[s]) that finishes last merges the splits' rows by
  // their LSEs (the reduce pass's arithmetic, in the kernel: no second launch) and writes
  // the output; it resets the counter, so CUDA-graph replays start from zero
  __shared__ int merger;
  __threadfence();
  __syncthreads();
  const int pc = seq * hkv + kvh0;
  if (threadIdx.x == 0) merger = atomicAdd(&counters[pc], 1) == num_splits - 1;
  __syncthreads();
  const bool wrote = merger;
  if (wrote) {
    __threadfence();
    for (int idx = threadIdx.x; idx < nt * GROUP * D; idx += WARPS * 32) {
      const int hk = kvh0 + (TEAMS ? idx / (GROUP * D) : 0);
      if (TEAMS && hk >= hkv) continue;
      const int h = (idx / D) % GROUP, d = idx % D;
      const long long row0 = ((long long)seq * (GROUP * hkv) + hk * GROUP + h) * num_splits;
      float mx = NEG_INF, den = 0.f, num = 0.f;
      for (int sp = 0; sp < num_splits; ++sp) {
        const float ls = __ldcg(part_lse + row0 + sp);
        const float o = __ldcg(part_o + (row0 + sp) * D + d);
        lse_fold(mx, den, num, ls, o);
      }
      float v = num / (den > 0.f ? den : 1.f);
      if (cap < L) v = __int_as_float(0x7fc00000);
      final_row(out, fin, idx, (long long)seq * so_s + (long long)(hk * GROUP + h) * so_h + d, v);
    }
    if (threadIdx.x == 0) counters[pc] = 0;   // ready for the next launch (CUDA graphs)
  }
#else
  constexpr bool wrote = true;
#endif
#if EPILOGUE == 2
  // the normalized rows back to model space, o_w ⊙ H o, written as the output
  if (wrote) {
    __syncthreads();
    fwht_rows(fin, nt * GROUP);
#if EARLY && !BALANCED
    // OWN consecutive rows' elements per pass, so ow's index is a compile-time constant
    for (int i0 = threadIdx.x; i0 < nt * GROUP * D; i0 += OWN * WARPS * 32) {
#pragma unroll
      for (int k = 0; k < OWN; ++k) {
        const int idx = i0 + k * WARPS * 32;   // o_w[idx % D] == ow[k]
        const int hk = kvh0 + (TEAMS ? idx / (GROUP * D) : 0);
        if (idx < nt * GROUP * D && (!TEAMS || hk < hkv))
          store_out(out, (long long)seq * so_s +
                             (long long)(hk * GROUP + (idx / D) % GROUP) * so_h + idx % D,
                    fin[idx] * ow[k]);
      }
    }
#else
    for (int idx = threadIdx.x; idx < nt * GROUP * D; idx += WARPS * 32) {
      const int hk = kvh0 + (TEAMS ? idx / (GROUP * D) : 0);
      if (!TEAMS || hk < hkv)
        store_out(out, (long long)seq * so_s + (long long)(hk * GROUP + (idx / D) % GROUP) * so_h +
                           idx % D, fin[idx] * o_w[idx % D]);
    }
#endif
  }
#endif
#if BALANCED
  __syncthreads();   // the next segment reuses the shared memory
  x = seg_end;
  if (x >= P + n) {   // the next pair: the next KV head, or the next sequence with steps
    P += n;
    if (++kvh == hkv) {
      kvh = 0;
      do {
        ++seq;
        n = seq < num_seqs ? steps_of(seq_lens, seq, window, cap) : 0;
      } while (seq < num_seqs && n == 0);
    }
  }
  }   // segments
  // pairs without steps (length 0, or a window past the block table): zero rows (NaN rows
  // for a length past the block table), the pairs spread over the whole grid
  for (int p = blockIdx.x; p < num_seqs * hkv; p += gridDim.x) {
    const int s = p / hkv;
    if (steps_of(seq_lens, s, window, cap) > 0) continue;
    const float v = cap < seq_lens[s] ? __int_as_float(0x7fc00000) : 0.f;
    for (int idx = threadIdx.x; idx < GROUP * D; idx += WARPS * 32)
      store_out(out, (long long)s * so_s + (long long)((p % hkv) * GROUP + idx / D) * so_h +
                     idx % D, v);
  }
#else
  }
  PROBE_AT(6);
#endif
}
