// One decode step's attention on CPU (an XLA FFI custom call): each sequence's one new token
// attends to itself and to the filled slots of one layer of a stacked KV cache.
//
// For each sequence b, kv head k and query g of that head's group, over the new token (when it is
// not padding) and the cache slots s below `used` that hold a position in [0, position of b's
// new token]:
//   score[s] = sum over key parts p of  q_p[b, k, g, :] . key_p[s, :]
//   out[:]   = sum_s softmax(score)[s] * value[s, :]        (0 where nothing qualifies)
// Nothing is copied out of the stacked caches: each sequence's slots of the layer are read where
// they lie, once, in order; the (b, k) rows are shared out between this thread and XLA's
// intra-op pool.
//
// Built by `models.kernels` (c++ -O3 -march=native -fopenmp-simd) on first use.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kMaxParts = 4;

struct Part {
  const float* query;  // (B, K, G, dim)
  const float* new_key;  // (B, K, dim)
  const float* cache;  // layer's (B, S, K, dim)
  int64_t dim;
};

// 16 floats, the width of an AVX-512 register; the compiler splits it on narrower hardware.
constexpr int64_t kLanes = 16;
typedef float Floats __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t Ints __attribute__((vector_size(kLanes * sizeof(int32_t))));

#if defined(__clang__)
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, Ints{__VA_ARGS__})
#endif

inline Floats Load(const float* p) {
  Floats v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void Store(float* p, Floats v) { std::memcpy(p, &v, sizeof(v)); }

inline Floats Splat(float x) { return Floats{} + x; }

inline float SumLanes(Floats v) {
  float total = 0.0f;
  for (int64_t i = 0; i < kLanes; ++i) total += v[i];
  return total;
}

inline float MaxLanes(Floats v) {
  float top = v[0];
  for (int64_t i = 1; i < kLanes; ++i) top = std::max(top, v[i]);
  return top;
}

// Lane j of the result is the sum of the lanes of v[j]: four rounds of pairing two vectors into
// one that holds half of each one's lanes, summed, so 16 dot products cost 15 vector additions.
inline Floats SumEachLanes(const Floats v[kLanes]) {
  Floats halves[8], quarters[4], eighths[2];
  for (int i = 0; i < 8; ++i) {
    const Floats a = v[2 * i], b = v[2 * i + 1];
    halves[i] = SHUFFLE(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                SHUFFLE(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  }
  for (int i = 0; i < 4; ++i) {
    const Floats a = halves[2 * i], b = halves[2 * i + 1];
    quarters[i] = SHUFFLE(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
                  SHUFFLE(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  }
  for (int i = 0; i < 2; ++i) {
    const Floats a = quarters[2 * i], b = quarters[2 * i + 1];
    eighths[i] = SHUFFLE(a, b, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
                 SHUFFLE(a, b, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  }
  const Floats a = eighths[0], b = eighths[1];
  return SHUFFLE(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         SHUFFLE(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

// e^x for x <= 0 (a score minus its row's maximum; -inf gives 0): 2^n * e^r with
// n = floor(x / ln 2 + 1/2), |r| <= ln 2 / 2, e^r by a degree-6 polynomial (relative error about
// 2e-7, as the Cephes library's expf). Arguments below -87 give 0.
inline Floats ExpNonPositive(Floats x) {
  const Floats low = Splat(-87.0f);
  const Floats clamped = x < low ? low : x;
  const Floats t = clamped * 1.44269504088896341f + 0.5f;
  Ints n = __builtin_convertvector(t, Ints);  // rounds toward zero; t < 0, so one too high where t is not whole
  const Floats truncated = __builtin_convertvector(n, Floats);
  n = truncated > t ? n - 1 : n;
  const Floats nf = __builtin_convertvector(n, Floats);
  const Floats r = (clamped - nf * 0.693359375f) + nf * 2.12194440e-4f;
  Floats p = Splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  Floats scale;
  const Ints bits = (n + 127) << 23;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < low ? Floats{} : p * scale;
}

inline float Dot(const float* a, const float* b, int64_t n) {
  float total = 0.0f;
#pragma omp simd reduction(+ : total)
  for (int64_t i = 0; i < n; ++i) total += a[i] * b[i];
  return total;
}

struct Problem {
  Part parts[kMaxParts];
  int num_parts;
  const float* values;  // layer's (B, S, K, E)
  const float* new_values;  // (B, K, E)
  const int32_t* slot_positions;  // (B, S)
  const int32_t* positions;  // (B,)
  const int32_t* new_attended;  // (B,): 0 where the new token is padding (not attended to)
  int64_t batch, slots, kv_heads, group, value_dim, used;
  float* out;  // (B, K, G, E)
};

// Work shared by the threads of one call: rows (b, k) of the flattened (B, K) are taken one at a
// time from `next`; `done` counts the finished ones.
struct Shared {
  Problem problem;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

// The scores of two queries (dim floats per part) against slots [s0, s0 + 16) of one kv head, key
// rows `stride_rows` rows apart: each key row is loaded once for both.
inline void ChunkScores(const Problem& pr, const float* const* keys, const float* const* q0s,
                         const float* const* q1s, int64_t s0, int64_t stride_rows, Floats& out0, Floats& out1) {
  Floats sums0[kLanes], sums1[kLanes];
  for (int64_t j = 0; j < kLanes; ++j) sums0[j] = sums1[j] = Floats{};
  for (int p = 0; p < pr.num_parts; ++p) {
    const int64_t dim = pr.parts[p].dim;
    const float* q0 = q0s[p];
    const float* q1 = q1s[p];
    for (int64_t j = 0; j < kLanes; ++j) {
      const float* key = keys[p] + (s0 + j) * stride_rows * dim;
      Floats a0 = sums0[j], a1 = sums1[j];
      for (int64_t d = 0; d < dim; d += kLanes) {
        const Floats kv = Load(key + d);
        a0 += Load(q0 + d) * kv;
        a1 += Load(q1 + d) * kv;
      }
      sums0[j] = a0;
      sums1[j] = a1;
    }
  }
  out0 = SumEachLanes(sums0);
  out1 = SumEachLanes(sums1);
}

void AttendRows(Shared& shared) {
  const Problem& pr = shared.problem;
  const int64_t S = pr.slots, K = pr.kv_heads, G = pr.group, E = pr.value_dim, used = pr.used;
  const int64_t rows = pr.batch * K;
  const int64_t padded = (used + kLanes - 1) / kLanes * kLanes;
  bool vector_dims = E % kLanes == 0;
  for (int p = 0; p < pr.num_parts; ++p) vector_dims = vector_dims && pr.parts[p].dim % kLanes == 0;
  std::vector<float> scores(G * std::max<int64_t>(padded, kLanes));
  std::vector<unsigned char> valid(std::max<int64_t>(padded, 1));
  std::vector<float> bias(std::max<int64_t>(padded, 1));
  std::vector<float> own_weights(G), norms(G);
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (int64_t row; (row = shared.next.fetch_add(1, std::memory_order_relaxed)) < rows;
       shared.done.fetch_add(1, std::memory_order_release)) {
    const int64_t b = row / K, k = row % K;
    const int32_t* slot_pos = pr.slot_positions + b * S;
    const int32_t position = pr.positions[b];
    const bool new_attended = pr.new_attended[b] != 0;
    float* out = pr.out + row * G * E;
    std::fill(out, out + G * E, 0.0f);
    int64_t any = new_attended;
    for (int64_t s = 0; s < padded; ++s) {
      valid[s] = s < used && slot_pos[s] >= 0 && slot_pos[s] <= position;
      bias[s] = valid[s] ? 0.0f : kNegInf;
      any += valid[s];
    }
    if (any == 0) continue;  // nothing to attend to: zeros (the loop's increment counts the row done)
    // Scores, 16 slots at a time per query, plus the mask's bias (0, or -inf for a masked slot).
    const float* keys[kMaxParts];
    for (int p = 0; p < pr.num_parts; ++p) keys[p] = pr.parts[p].cache + (b * S * K + k) * pr.parts[p].dim;
    // Whole 16-slot chunks with vector dims two queries at a time (an odd group's last query
    // paired with itself); what remains (a chunk past the cache's end, other dims) slot by slot.
    int64_t vectored = 0;
    if (vector_dims) {
      for (int64_t s0 = 0; s0 + kLanes <= std::min(padded, S); s0 += kLanes) {
        for (int64_t g = 0; g < G; g += 2) {
          const int64_t g1 = std::min(g + 1, G - 1);
          const float* q0s[kMaxParts];
          const float* q1s[kMaxParts];
          for (int p = 0; p < pr.num_parts; ++p) {
            q0s[p] = pr.parts[p].query + (row * G + g) * pr.parts[p].dim;
            q1s[p] = pr.parts[p].query + (row * G + g1) * pr.parts[p].dim;
          }
          Floats a, c;
          ChunkScores(pr, keys, q0s, q1s, s0, K, a, c);
          const Floats bs = Load(bias.data() + s0);
          Store(scores.data() + g * padded + s0, a + bs);
          if (g1 != g) Store(scores.data() + g1 * padded + s0, c + bs);
        }
        vectored = s0 + kLanes;
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      const float* queries[kMaxParts];
      for (int p = 0; p < pr.num_parts; ++p) queries[p] = pr.parts[p].query + (row * G + g) * pr.parts[p].dim;
      float* sc = scores.data() + g * padded;
      for (int64_t s0 = vectored; s0 < used; s0 += kLanes) {
        for (int64_t s = s0; s < std::min(s0 + kLanes, S); ++s) {
          float dot = 0.0f;
          for (int p = 0; p < pr.num_parts; ++p) {
            dot += Dot(queries[p], keys[p] + s * K * pr.parts[p].dim, pr.parts[p].dim);
          }
          sc[s] = dot + bias[s];
        }
        for (int64_t s = S; s < s0 + kLanes; ++s) sc[s] = kNegInf;
      }
      // The new token's own score, then softmax numerators exp(score - max), 0 where masked.
      float own = kNegInf;
      if (new_attended) {
        own = 0.0f;
        for (int p = 0; p < pr.num_parts; ++p) {
          own += Dot(queries[p], pr.parts[p].new_key + row * pr.parts[p].dim, pr.parts[p].dim);
        }
      }
      Floats top = Splat(own);
      for (int64_t s0 = 0; s0 < padded; s0 += kLanes) {
        const Floats x = Load(sc + s0);
        top = x > top ? x : top;
      }
      const float m = MaxLanes(top);
      Floats total{};
      for (int64_t s0 = 0; s0 < padded; s0 += kLanes) {
        const Floats e = ExpNonPositive(Load(sc + s0) - m);
        Store(sc + s0, e);
        total += e;
      }
      own_weights[g] = new_attended ? ExpNonPositive(Splat(own - m))[0] : 0.0f;
      norms[g] = 1.0f / (SumLanes(total) + own_weights[g]);
    }
    // Weighted values: up to 8 queries at a time against 16 value columns, slot by slot, starting
    // from the new token's value; then divided by the softmax's sum.
    const float* values = pr.values + (b * S * K + k) * E;
    const float* new_value = pr.new_values + row * E;
    for (int64_t g0 = 0; g0 < G; g0 += 8) {
      const int64_t gn = std::min<int64_t>(8, G - g0);
      if (!vector_dims) {
        for (int64_t g = g0; g < g0 + gn; ++g) {
          for (int64_t e = 0; e < E; ++e) out[g * E + e] = own_weights[g] * new_value[e];
        }
        for (int64_t s = 0; s < used; ++s) {
          if (!valid[s]) continue;
          const float* value = values + s * K * E;
          for (int64_t g = g0; g < g0 + gn; ++g) {
            const float p = scores[g * padded + s];
            float* o = out + g * E;
#pragma omp simd
            for (int64_t e = 0; e < E; ++e) o[e] += p * value[e];
          }
        }
        for (int64_t g = g0; g < g0 + gn; ++g) {
          for (int64_t e = 0; e < E; ++e) out[g * E + e] *= norms[g];
        }
        continue;
      }
      for (int64_t e0 = 0; e0 < E; e0 += kLanes) {
        Floats sums[8];
        const Floats own_value = Load(new_value + e0);
        for (int64_t i = 0; i < gn; ++i) sums[i] = own_weights[g0 + i] * own_value;
        for (int64_t s = 0; s < used; ++s) {
          if (!valid[s]) continue;
          const Floats value = Load(values + s * K * E + e0);
          for (int64_t i = 0; i < gn; ++i) sums[i] += scores[(g0 + i) * padded + s] * value;
        }
        for (int64_t i = 0; i < gn; ++i) Store(out + (g0 + i) * E + e0, sums[i] * norms[g0 + i]);
      }
    }
  }
}

ffi::Error DecodeAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> value_cache,
                               ffi::Buffer<ffi::F32> new_values, ffi::Buffer<ffi::S32> layer_arg,
                               ffi::Buffer<ffi::S32> used_arg, ffi::Buffer<ffi::S32> slot_positions,
                               ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::S32> new_attended,
                               ffi::RemainingArgs parts, ffi::ResultBuffer<ffi::F32> out, int64_t threads) {
  const auto vdims = value_cache.dimensions();
  if (vdims.size() != 5) return ffi::Error::InvalidArgument("value cache: expected (L, B, S, K, E)");
  const int64_t L = vdims[0], B = vdims[1], S = vdims[2], K = vdims[3], E = vdims[4];
  const auto nvd = new_values.dimensions();
  if (nvd.size() != 3 || nvd[0] != B || nvd[1] != K || nvd[2] != E) {
    return ffi::Error::InvalidArgument("new values: expected (B, K, E) of the value cache");
  }
  const int64_t layer = layer_arg.typed_data()[0];
  if (layer < 0 || layer >= L) return ffi::Error::InvalidArgument("layer out of range");
  if (parts.size() == 0 || parts.size() % 3 != 0 || parts.size() / 3 > kMaxParts) {
    return ffi::Error::InvalidArgument("expected 1 to 4 (query, new key, key cache) triples");
  }
  auto shared = std::make_shared<Shared>();
  Problem& pr = shared->problem;
  pr.num_parts = static_cast<int>(parts.size() / 3);
  int64_t G = -1;
  for (int p = 0; p < pr.num_parts; ++p) {
    auto query = parts.get<ffi::Buffer<ffi::F32>>(3 * p);
    auto new_key = parts.get<ffi::Buffer<ffi::F32>>(3 * p + 1);
    auto cache = parts.get<ffi::Buffer<ffi::F32>>(3 * p + 2);
    if (query.has_error()) return query.error();
    if (new_key.has_error()) return new_key.error();
    if (cache.has_error()) return cache.error();
    const auto qd = query->dimensions();
    const auto nd = new_key->dimensions();
    const auto cd = cache->dimensions();
    if (qd.size() != 4 || nd.size() != 3 || cd.size() != 5 || qd[0] != B || qd[1] != K || nd[0] != B ||
        nd[1] != K || nd[2] != qd[3] || cd[0] != L || cd[1] != B || cd[2] != S || cd[3] != K || cd[4] != qd[3] ||
        (G >= 0 && qd[2] != G)) {
      return ffi::Error::InvalidArgument(
          "query (B, K, G, D), new key (B, K, D) and key cache (L, B, S, K, D) do not match");
    }
    G = qd[2];
    pr.parts[p] = Part{query->typed_data(), new_key->typed_data(), cache->typed_data() + layer * B * S * K * cd[4],
                       cd[4]};
  }
  pr.values = value_cache.typed_data() + layer * B * S * K * E;
  pr.new_values = new_values.typed_data();
  pr.slot_positions = slot_positions.typed_data();
  pr.positions = positions.typed_data();
  pr.new_attended = new_attended.typed_data();
  pr.batch = B;
  pr.slots = S;
  pr.kv_heads = K;
  pr.group = G;
  pr.value_dim = E;
  pr.used = std::clamp<int64_t>(used_arg.typed_data()[0], 0, S);
  pr.out = out->typed_data();

  // Helpers from XLA's intra-op pool take rows alongside this thread. This thread waits only for
  // the rows, not for the helpers: one that starts late finds no row left and drops its share of
  // `shared`.
  if (B * K == 0) return ffi::Error::Success();  // nothing to write
  const int64_t helpers = std::clamp<int64_t>(std::min(threads - 1, pool.num_threads()), 0, B * K - 1);
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule([shared] { AttendRows(*shared); });
  AttendRows(*shared);
  while (shared->done.load(std::memory_order_acquire) < B * K) {
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PodtrainDecodeAttention, DecodeAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // value cache (L, B, S, K, E)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // new values (B, K, E)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slots used
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slot positions (B, S)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // new token positions (B,)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // new token attended to (B,)
                                  .RemainingArgs()               // (query, new key, key cache) per part
                                  .Ret<ffi::Buffer<ffi::F32>>()  // attention output (B, K, G, E)
                                  .Attr<int64_t>("threads"));
