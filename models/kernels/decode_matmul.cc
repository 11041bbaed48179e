// A decode step's matmuls on CPU (an XLA FFI custom call): y (M, N) = x (M, K) @ w (K, N) for a
// few rows (M = the batch of one-token steps), the weight streamed once.
//
// XLA:CPU runs such a product on one core. Here the columns are cut into tasks of `block` columns,
// shared between this thread and XLA's intra-op pool; a task keeps the sums of up to 4 rows x 64
// columns in registers and walks the weight's rows in order, so each weight element is loaded
// once (per 4 rows of x). Built by `models.kernels` with the decode-attention kernel.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kTile = 4 * kLanes;  // columns summed in registers at once
typedef float Floats __attribute__((vector_size(kLanes * sizeof(float))));

inline Floats Load(const float* p) {
  Floats v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void Store(float* p, Floats v) { std::memcpy(p, &v, sizeof(v)); }

struct Product {
  const float* x;  // (M, K)
  const float* w;  // (K, N)
  float* y;  // (M, N)
  int64_t m, k, n, block, tasks;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

// y[r0:r0+ROWS, c0:c1] for ROWS rows of x.
template <int ROWS>
void Columns(const Product& pr, int64_t r0, int64_t c0, int64_t c1) {
  const float* x = pr.x + r0 * pr.k;
  float* y = pr.y + r0 * pr.n;
  int64_t c = c0;
  for (; c + kTile <= c1; c += kTile) {
    Floats sums[ROWS][4] = {};
    const float* column = pr.w + c;
    for (int64_t i = 0; i < pr.k; ++i, column += pr.n) {
      const Floats w0 = Load(column), w1 = Load(column + kLanes), w2 = Load(column + 2 * kLanes),
                   w3 = Load(column + 3 * kLanes);
      for (int r = 0; r < ROWS; ++r) {
        const float xv = x[r * pr.k + i];
        sums[r][0] += xv * w0;
        sums[r][1] += xv * w1;
        sums[r][2] += xv * w2;
        sums[r][3] += xv * w3;
      }
    }
    for (int r = 0; r < ROWS; ++r) {
      for (int q = 0; q < 4; ++q) Store(y + r * pr.n + c + q * kLanes, sums[r][q]);
    }
  }
  for (; c < c1; ++c) {  // the last columns of a width that is not a whole tile
    for (int r = 0; r < ROWS; ++r) {
      float total = 0.0f;
      for (int64_t i = 0; i < pr.k; ++i) total += x[r * pr.k + i] * pr.w[i * pr.n + c];
      y[r * pr.n + c] = total;
    }
  }
}

void Work(Product& pr) {
  for (int64_t task; (task = pr.next.fetch_add(1, std::memory_order_relaxed)) < pr.tasks;
       pr.done.fetch_add(1, std::memory_order_release)) {
    const int64_t c0 = task * pr.block, c1 = std::min(pr.n, c0 + pr.block);
    for (int64_t r0 = 0; r0 < pr.m; r0 += 4) {
      switch (std::min<int64_t>(4, pr.m - r0)) {
        case 4: Columns<4>(pr, r0, c0, c1); break;
        case 3: Columns<3>(pr, r0, c0, c1); break;
        case 2: Columns<2>(pr, r0, c0, c1); break;
        default: Columns<1>(pr, r0, c0, c1); break;
      }
    }
  }
}

ffi::Error DecodeMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                            ffi::ResultBuffer<ffi::F32> y, int64_t threads, int64_t block) {
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != 2 || xd[1] != wd[0] || yd[0] != xd[0] || yd[1] != wd[1]) {
    return ffi::Error::InvalidArgument("expected x (M, K), w (K, N) and y (M, N)");
  }
  if (block < kTile || block % kTile != 0) return ffi::Error::InvalidArgument("block: expected a multiple of 64");
  if (xd[0] == 0 || wd[1] == 0) return ffi::Error::Success();  // nothing to write
  auto pr = std::make_shared<Product>();
  pr->x = x.typed_data();
  pr->w = w.typed_data();
  pr->y = y->typed_data();
  pr->m = xd[0];
  pr->k = xd[1];
  pr->n = wd[1];
  pr->block = block;
  pr->tasks = (pr->n + block - 1) / block;
  // As in the attention kernel: helpers take tasks alongside this thread, which waits for the
  // tasks, never for a helper that starts late.
  const int64_t helpers = std::clamp<int64_t>(std::min(threads - 1, pool.num_threads()), 0, pr->tasks - 1);
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule([pr] { Work(*pr); });
  Work(*pr);
  while (pr->done.load(std::memory_order_acquire) < pr->tasks) {
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PodtrainDecodeMatmul, DecodeMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x (M, K)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w (K, N)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y (M, N)
                                  .Attr<int64_t>("threads")
                                  .Attr<int64_t>("block"));
