// moefx host expert kernel: the routed experts of a small-M MoE call in one pass over their weights.
//
// Decode on the host is bound by DRAM bandwidth: each routed expert's weights are read once per call, so the
// kernel streams each weight row once and applies it to every pair (token, slot) routed to that expert. Two
// phases inside one OpenMP team (torch's own libgomp, so no second thread pool):
//   1. gate/up: units of (expert, block of I rows); act[pair, i] = silu(x . gate_i) * (x . up_i)
//   2. down:    units of blocks of H rows, every expert inside, so each out[token, h] has one writer.
// Weights are bf16, fp32 or int8 (with one fp32 scale per output row). `round_bf16` rounds where a bf16
// PyTorch expert rounds (linear outputs, silu, the product), so results follow the module's own numerics.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

namespace {

inline float bits_to_float(uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline uint32_t bits_to_u32(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
}

inline float to_f32(uint16_t v) { return bits_to_float(uint32_t(v) << 16); }
inline float to_f32(float v) { return v; }
inline float to_f32(int8_t v) { return float(v); }

inline float round_bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7f800000u) == 0x7f800000u) return f;  // inf / nan pass through
    u += 0x7fffu + ((u >> 16) & 1u);                  // round to nearest even
    return bits_to_float(u & 0xffff0000u);
}

#if defined(__AVX512F__)
constexpr int kLanes = 16;
using vec = __m512;
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline vec vload(const uint16_t* p) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
inline vec vload(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(vec a) { return _mm512_reduce_add_ps(a); }
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kLanes = 8;
using vec = __m256;
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline vec vload(const uint16_t* p) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
inline vec vload(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(vec a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}
#else
constexpr int kLanes = 1;
using vec = float;
inline vec vzero() { return 0.0f; }
template <typename W>
inline vec vload(const W* p) { return to_f32(*p); }
inline vec vfma(vec a, vec b, vec c) { return a * b + c; }
inline float vsum(vec a) { return a; }
#endif

constexpr int kPairs = 4;  // activation rows sharing one pass over a weight row (it stays in L1 between chunks)

inline void prefetch(const void* p) {
#if defined(__x86_64__) || defined(_M_X64)
    _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0);
#else
    (void)p;
#endif
}

// out[j] = w . xs[j] for NP activation rows, K elements each. `pf` > 0 prefetches that many bytes ahead of
// the weight stream (it runs on into the next rows, which follow in memory): the hardware prefetchers stop at
// 4 KiB page edges, and a weight row is about a page.
template <int NP, typename W>
inline void dot_rows(const W* w, const float* const* xs, int64_t K, float* out, int64_t pf) {
    vec acc[NP];
    for (int j = 0; j < NP; ++j) acc[j] = vzero();
    int64_t k = 0;
    for (; k + kLanes <= K; k += kLanes) {
        if (pf) prefetch(reinterpret_cast<const char*>(w + k) + pf);
        vec wv = vload(w + k);
        for (int j = 0; j < NP; ++j) acc[j] = vfma(wv, vload(xs[j] + k), acc[j]);
    }
    for (int j = 0; j < NP; ++j) {
        float s = vsum(acc[j]);
        for (int64_t t = k; t < K; ++t) s += to_f32(w[t]) * xs[j][t];
        out[j] = s;
    }
}

template <typename W>
inline void dot_chunk(const W* w, const float* const* xs, int np, int64_t K, float* out, int64_t pf) {
    switch (np) {
        case 1: dot_rows<1>(w, xs, K, out, pf); break;
        case 2: dot_rows<2>(w, xs, K, out, pf); break;
        case 3: dot_rows<3>(w, xs, K, out, pf); break;
        default: dot_rows<4>(w, xs, K, out, pf); break;
    }
}

inline float maybe_round(float v, bool r) { return r ? round_bf16(v) : v; }

template <typename W>
void moe_small_m(const float* x, int64_t H, int64_t I, const W* w13, const W* w2, const float* s13,
                 const float* s2, const int32_t* experts, const int32_t* starts, int32_t n_experts,
                 const int32_t* pair_token, const float* pair_weight, float* act, float* out, bool rnd,
                 int32_t threads, int64_t pf) {
    constexpr int64_t kRows1 = 16;  // gate/up rows per unit
    constexpr int64_t kRows2 = 16;  // down rows per unit
    const int64_t blocks1 = (I + kRows1 - 1) / kRows1;
    const int64_t units1 = int64_t(n_experts) * blocks1;
    const int64_t units2 = (H + kRows2 - 1) / kRows2;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t u = 0; u < units1; ++u) {
            const int64_t g = u / blocks1, r0 = (u % blocks1) * kRows1;
            const int64_t r1 = r0 + kRows1 < I ? r0 + kRows1 : I;
            const int64_t e = experts[g];
            const W* gate_w = w13 + e * 2 * I * H;
            const W* up_w = gate_w + I * H;
            for (int32_t p0 = starts[g]; p0 < starts[g + 1]; p0 += kPairs) {
                const int np = starts[g + 1] - p0 < kPairs ? starts[g + 1] - p0 : kPairs;
                const float* xs[kPairs];
                for (int j = 0; j < np; ++j) xs[j] = x + int64_t(pair_token[p0 + j]) * H;
                for (int64_t r = r0; r < r1; ++r) {
                    float gv[kPairs], uv[kPairs];
                    dot_chunk(gate_w + r * H, xs, np, H, gv, pf);
                    dot_chunk(up_w + r * H, xs, np, H, uv, pf);
                    const float gs = s13 ? s13[e * 2 * I + r] : 1.0f, us = s13 ? s13[e * 2 * I + I + r] : 1.0f;
                    for (int j = 0; j < np; ++j) {
                        const float gate = maybe_round(gv[j] * gs, rnd), up = maybe_round(uv[j] * us, rnd);
                        const float silu = maybe_round(gate / (1.0f + std::exp(-gate)), rnd);
                        act[int64_t(p0 + j) * I + r] = maybe_round(silu * up, rnd);
                    }
                }
            }
        }
#pragma omp for schedule(static)
        for (int64_t u = 0; u < units2; ++u) {
            const int64_t h0 = u * kRows2, h1 = h0 + kRows2 < H ? h0 + kRows2 : H;
            for (int32_t g = 0; g < n_experts; ++g) {
                const int64_t e = experts[g];
                for (int32_t p0 = starts[g]; p0 < starts[g + 1]; p0 += kPairs) {
                    const int np = starts[g + 1] - p0 < kPairs ? starts[g + 1] - p0 : kPairs;
                    const float* as[kPairs];
                    for (int j = 0; j < np; ++j) as[j] = act + int64_t(p0 + j) * I;
                    for (int64_t h = h0; h < h1; ++h) {
                        float yv[kPairs];
                        dot_chunk(w2 + (e * H + h) * I, as, np, I, yv, pf);
                        const float ds = s2 ? s2[e * H + h] : 1.0f;
                        for (int j = 0; j < np; ++j)
                            out[int64_t(pair_token[p0 + j]) * H + h] += maybe_round(yv[j] * ds, rnd) * pair_weight[p0 + j];
                    }
                }
            }
        }
    }
}

// moe_small_m for weight format 0 bf16, 1 fp32, 2 int8 (per-row scales s13/s2); 1 for an unknown format.
int32_t small_m_any(int32_t weight_format, const float* x, int64_t H, int64_t I, const void* w13, const void* w2,
                    const float* s13, const float* s2, const int32_t* experts, const int32_t* starts,
                    int32_t n_experts, const int32_t* pair_token, const float* pair_weight, float* act, float* out,
                    bool rnd, int32_t threads, int64_t pf) {
    switch (weight_format) {
        case 0:
            moe_small_m(x, H, I, static_cast<const uint16_t*>(w13), static_cast<const uint16_t*>(w2), nullptr,
                        nullptr, experts, starts, n_experts, pair_token, pair_weight, act, out, rnd, threads, pf);
            return 0;
        case 1:
            moe_small_m(x, H, I, static_cast<const float*>(w13), static_cast<const float*>(w2), nullptr, nullptr,
                        experts, starts, n_experts, pair_token, pair_weight, act, out, rnd, threads, pf);
            return 0;
        case 2:
            moe_small_m(x, H, I, static_cast<const int8_t*>(w13), static_cast<const int8_t*>(w2), s13, s2, experts,
                        starts, n_experts, pair_token, pair_weight, act, out, rnd, threads, pf);
            return 0;
        default:
            return 1;
    }
}

// One whole small-M call from raw inputs, for a host function queued on a GPU stream (`stream_host.py`): the
// inputs were copied into pinned buffers ahead of it on the stream, the result is copied back after it. Routing
// is a stable counting sort by expert (the same pair order as `route()`'s stable argsort), so the sums and
// their order match the synchronous kernel path bit for bit.
struct HostJob {
    int32_t weight_format;  // as moefx_moe_small_m
    int32_t act_bf16;       // activations (x_in, y_out) bf16, else fp32; also the rounding switch
    int32_t ids_int64;      // top-k ids int64, else int32
    int32_t wts_bf16;       // top-k weights bf16, else fp32
    int32_t threads;
    int32_t m;
    int32_t top_k;
    int32_t status;  // 0 ok, else the weight format was not known
    int64_t H, I, E, prefetch;
    const void *w13, *w2;
    const float *s13, *s2;
    const void *x_in, *ids, *wts;
    void* y_out;
    float *x32, *act, *out32, *pair_weight;
    int32_t *experts, *starts, *pair_token;
};

void host_job(HostJob& j) {
    const int64_t pairs = int64_t(j.m) * j.top_k, n = int64_t(j.m) * j.H;
    std::vector<int32_t> count(j.E + 1, 0), slot(pairs, -1);
    for (int64_t p = 0; p < pairs; ++p) {
        const int64_t e = j.ids_int64 ? static_cast<const int64_t*>(j.ids)[p] : static_cast<const int32_t*>(j.ids)[p];
        if (e >= 0 && e < j.E) {
            slot[p] = int32_t(e);
            ++count[e];
        }
    }
    int32_t n_experts = 0;
    j.starts[0] = 0;
    for (int64_t e = 0; e < j.E; ++e) {
        if (!count[e]) continue;
        j.experts[n_experts] = int32_t(e);
        j.starts[n_experts + 1] = j.starts[n_experts] + count[e];
        count[e] = j.starts[n_experts];  // from here on: the next free position of expert e's pairs
        ++n_experts;
    }
    for (int64_t p = 0; p < pairs; ++p) {
        if (slot[p] < 0) continue;
        const int32_t at = count[slot[p]]++;
        j.pair_token[at] = int32_t(p / j.top_k);
        j.pair_weight[at] = j.wts_bf16 ? to_f32(static_cast<const uint16_t*>(j.wts)[p]) : static_cast<const float*>(j.wts)[p];
    }
    for (int64_t i = 0; i < n; ++i) {
        j.x32[i] = j.act_bf16 ? to_f32(static_cast<const uint16_t*>(j.x_in)[i]) : static_cast<const float*>(j.x_in)[i];
        j.out32[i] = 0.0f;
    }
    j.status = small_m_any(j.weight_format, j.x32, j.H, j.I, j.w13, j.w2, j.s13, j.s2, j.experts, j.starts, n_experts,
                           j.pair_token, j.pair_weight, j.act, j.out32, j.act_bf16 != 0, j.threads, j.prefetch);
    if (j.status) return;
    for (int64_t i = 0; i < n; ++i) {
        if (!j.act_bf16) {
            static_cast<float*>(j.y_out)[i] = j.out32[i];
            continue;
        }
        uint32_t u;
        std::memcpy(&u, &j.out32[i], 4);
        const bool nan = (u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu);
        static_cast<uint16_t*>(j.y_out)[i] = nan ? uint16_t(0x7fc0) : uint16_t(bits_to_u32(round_bf16(j.out32[i])) >> 16);
    }
}

}  // namespace

extern "C" {

// A CUDA host function (CUhostFn): runs `HostJob` `job` when the stream reaches it.
void moefx_host_job(void* job) { host_job(*static_cast<HostJob*>(job)); }

// sizeof(HostJob), so Python can check its ctypes mirror.
int64_t moefx_host_job_size() { return sizeof(HostJob); }

// Vector width the kernel was built for (1 = scalar), so Python can report it.
int32_t moefx_cpu_lanes() { return kLanes; }

// weight_format: 0 = bf16, 1 = fp32, 2 = int8 with per-row fp32 scales s13 [E, 2I] / s2 [E, H].
// Pairs are grouped by expert: pairs [starts[g], starts[g + 1]) belong to experts[g].
// out [M, H] fp32 is accumulated into; act is scratch of starts[n_experts] x I floats.
int32_t moefx_moe_small_m(int32_t weight_format, const float* x, int64_t H, int64_t I, const void* w13,
                          const void* w2, const float* s13, const float* s2, const int32_t* experts,
                          const int32_t* starts, int32_t n_experts, const int32_t* pair_token,
                          const float* pair_weight, float* act, float* out, int32_t round_bf16, int32_t threads,
                          int64_t prefetch_bytes) {
    return small_m_any(weight_format, x, H, I, w13, w2, s13, s2, experts, starts, n_experts, pair_token, pair_weight,
                       act, out, round_bf16 != 0, threads, prefetch_bytes);
}

}  // extern "C"
