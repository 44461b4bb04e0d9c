// Helpers the CPU kernels of every operation share: sums over tokens in a fixed order, and dot products in lanes.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <mutex>
#include <vector>

namespace ddl {

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
inline std::vector<double> sum_over_tokens(int64_t n, int64_t width, const Body& body) {
  TokenSums sums(width);
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
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
