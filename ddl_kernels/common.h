// Helpers the CPU kernels of every operation share: loops over threads, sums over tokens in a fixed order, and dot
// products in lanes. Plain C++ and OpenMP, no libtorch: the library builds where pip installs the package (no torch in
// its build environment), and ddl_kernels/native.py calls it through ctypes with the tensors' pointers.
#pragma once
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <type_traits>
#include <vector>

namespace ddl {

// f(begin, end) over chunks of [0, n) on up to `threads` threads (the caller's torch.get_num_threads()), split as
// at::parallel_for splits them: serially unless n > grain and threads > 1 (and not inside a parallel region); else the
// team's first min(team, n / grain rounded up) threads take one chunk each, n / that rounded up long, in token order.
// The chunks, and so the sums sum_over_tokens flushes per chunk, depend on n, grain and the thread count only.
// torch's wheels ship libgomp under the system's name (libgomp.so.1): loaded after torch, this library shares torch's
// OpenMP runtime and thread pool instead of starting a second one.
template <typename F>
inline void parallel_for(int64_t n, int64_t grain, int threads, const F& f) {
  if (n <= 0) return;
  if (n <= grain || n <= 1 || threads <= 1 || omp_in_parallel()) {
    f(int64_t(0), n);
    return;
  }
#pragma omp parallel num_threads(threads)
  {
    int64_t team = omp_get_num_threads();
    if (grain > 0) team = std::min(team, (n + grain - 1) / grain);
    const int64_t chunk = (n + team - 1) / team, begin = omp_get_thread_num() * chunk;
    if (begin < n) f(begin, std::min(n, begin + chunk));
  }
}

// f(T()) with T = double when f64, else float: the kernels' two dtypes (fp64, fp32).
template <typename F>
inline void by_dtype(int f64, const F& f) {
  if (f64) f(double(0)); else f(float(0));
}

// An input's pointer, as the C functions take it (void: one signature for both dtypes).
template <typename T>
inline const T* in(const void* p) { return static_cast<const T*>(p); }

// A C function's arguments, which ddl_kernels/native.py packs into one buffer (struct.Struct, fields of 8 bytes in the
// struct's order: no padding) and passes as one pointer: ctypes converts that one argument instead of twenty, a few
// microseconds a call, and a decoding step makes two calls a sublayer. Copied out: the buffer need not be aligned.
template <typename Args>
inline Args unpack(const void* packed) {
  Args args;
  std::memcpy(&args, packed, sizeof(Args));
  return args;
}

// Sums over tokens of per-token vectors (the weight gradients). Each chunk of tokens accumulates in T (vectorised,
// in a buffer of its own: no false sharing) and flushes into double every 64 tokens; the chunks' sums are then added
// in token order, so the result does not depend on which thread finished first.
class TokenSums {
 public:
  explicit TokenSums(int64_t width) : width_(width) {}
  template <typename T>
  void flush(std::vector<T>& partial, std::vector<double>& sums) {
    for (int64_t k = 0; k < width_; ++k) { sums[k] += double(partial[k]); partial[k] = T(0); }
  }
  void add(int64_t begin, std::vector<double>&& sums) {
    std::lock_guard<std::mutex> guard(lock_);
    chunks_.emplace_back(begin, std::move(sums));
  }
  std::vector<double> total() {
    std::sort(chunks_.begin(), chunks_.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    std::vector<double> out(width_, 0.0);
    for (const auto& chunk : chunks_)
      for (int64_t k = 0; k < width_; ++k) out[k] += chunk.second[k];
    return out;
  }
  static constexpr int64_t kFlushEvery = 64;

 private:
  int64_t width_;
  std::mutex lock_;
  std::vector<std::pair<int64_t, std::vector<double>>> chunks_;
};

// sums[q] = sum over tokens t < n of what body(t, partial) adds to partial[q] (q < width): tokens split over threads,
// each chunk's partial in T flushed into double every kFlushEvery tokens, the chunks then added in token order.
template <typename T, typename Body>
inline std::vector<double> sum_over_tokens(int64_t n, int64_t width, int threads, const Body& body) {
  TokenSums sums(width);
  parallel_for(n, 16, threads, [&](int64_t begin, int64_t end) {
    std::vector<T> partial(width, T(0));
    std::vector<double> chunk(width, 0.0);
    for (int64_t t = begin; t < end; ++t) {
      body(t, partial.data());
      if ((t - begin + 1) % TokenSums::kFlushEvery == 0) sums.flush(partial, chunk);
    }
    sums.flush(partial, chunk);
    sums.add(begin, std::move(chunk));
  });
  return sums.total();
}

// a . b over d numbers, summed in two vectors' width of lanes (independent chains, added at the end).
template <typename T>
inline T dot(const T* a, const T* b, int64_t d) {
  constexpr int L = 64 / sizeof(T);
  T lanes[L] = {};
  int64_t i = 0;
  for (; i + L <= d; i += L)
    for (int l = 0; l < L; ++l) lanes[l] += a[i + l] * b[i + l];
  T sum = 0;
  for (int64_t k = i; k < d; ++k) sum += a[k] * b[k];
  for (int l = 0; l < L; ++l) sum += lanes[l];
  return sum;
}

// out[j] = a . m[j] for the rows of m (stride d), one row after another: a token's state rows are then read as one
// stream in address order, which the hardware prefetchers follow; reading the rows side by side (d_v streams d
// apart, each only d long before the next token's) left the loads waiting on memory.
template <typename T>
inline void row_dots(const T* a, const T* m, int64_t d, int64_t rows, T* out) {
  for (int64_t j = 0; j < rows; ++j) out[j] = dot(a, m + j * d, d);
}

}  // namespace ddl
