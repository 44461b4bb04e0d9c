// EC, the embedding convolution into the expanded state, and its backward (ddl_kernels/conv).
#include "common.h"

namespace ddl {

// EC, the transpose of the TC readout: y[t, j, i] = sum_s taps[s, j, i] x[t - (K-1) + s, i], zero before token 0,
// from x (B, T, d) to the state (B, T, d_v, d); each state row written once.
template <typename T>
void conv_forward_impl(const T* x, const T* taps, int64_t batch, int64_t len, int64_t k, int64_t nv, int64_t d, T* y,
                       int threads) {
  parallel_for(batch * len, 16, threads, [&](int64_t begin, int64_t end) {
    for (int64_t bt = begin; bt < end; ++bt) {
      const int64_t t = bt % len, first = std::max<int64_t>(0, k - 1 - t);
      T* yt = y + bt * nv * d;
      for (int64_t j = 0; j < nv; ++j) {
        T* yj = yt + j * d;
        for (int64_t i = 0; i < d; ++i) yj[i] = 0;
        for (int64_t s = first; s < k; ++s) {
          const T* xs = x + (bt - (k - 1) + s) * d; const T* w = taps + (s * nv + j) * d;
#pragma omp simd
          for (int64_t i = 0; i < d; ++i) yj[i] += w[i] * xs[i];
        }
      }
    }
  });
}

// dx[t, i] = sum_s sum_j taps[s, j, i] G[t + (K-1) - s, j, i];  dtaps[s, j, i] = sum_t x[t - (K-1) + s, i] G[t, j, i].
template <typename T>
void conv_backward_impl(const T* g, const T* x, const T* taps, int64_t batch, int64_t len, int64_t k, int64_t nv,
                        int64_t d, T* gx, T* gtaps, int threads) {
  // the tap gradients
  const auto total = sum_over_tokens<T>(batch * len, k * nv * d, threads, [&](int64_t bt, T* partial) {
    const int64_t t = bt % len;
    T* gxt = gx + bt * d;
    for (int64_t i = 0; i < d; ++i) gxt[i] = 0;
    for (int64_t s = std::max<int64_t>(0, t + k - len); s < k; ++s) {  // output t + (K-1) - s reads t via tap s
      const T* gs = g + (bt + (k - 1) - s) * nv * d;
      for (int64_t j = 0; j < nv; ++j) {
        const T* w = taps + (s * nv + j) * d; const T* gj = gs + j * d;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) gxt[i] += w[i] * gj[i];
      }
    }
    const T* gt = g + bt * nv * d;  // output t's gradient, against the inputs it read
    for (int64_t s = std::max<int64_t>(0, k - 1 - t); s < k; ++s) {
      const T* xs = x + (bt - (k - 1) + s) * d;
      for (int64_t j = 0; j < nv; ++j) {
        const T* gj = gt + j * d; T* pw = partial + (s * nv + j) * d;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) pw[i] += xs[i] * gj[i];
      }
    }
  });
  for (size_t q = 0; q < total.size(); ++q) gtaps[q] = T(total[q]);
}

// One decoding step of EC from the cache's window, advanced in place: past (B, d, K-1) holds the K-1 embeddings
// before the new one x (its embedding (B, 1, d)), time last; the weight is the model's (K, d, d_v).
// y[b, j, i] = sum_s w[s, i, j] window[b, i, s] summed in tap order (to rounding what conv_forward gives: it may
// vectorise its sums), then past drops its oldest embedding and takes x.
template <typename T>
void conv_step_impl(T* past, const T* x, const T* w, int64_t batch, int64_t k, int64_t nv, int64_t d, T* y,
                    int threads) {
  const int64_t kp = k - 1;
  parallel_for(batch, 1, threads, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      T* pb = past + b * d * kp; const T* xb = x + b * d; T* yb = y + b * nv * d;
      for (int64_t i = 0; i < d; ++i) {
        T* p = pb + i * kp;
        for (int64_t j = 0; j < nv; ++j) {
          T acc = 0;
          for (int64_t s = 0; s < kp; ++s) acc += w[(s * d + i) * nv + j] * p[s];
          yb[j * d + i] = acc + w[(kp * d + i) * nv + j] * xb[i];
        }
        for (int64_t s = 0; s + 1 < kp; ++s) p[s] = p[s + 1];
        p[kp - 1] = xb[i];
      }
    }
  });
}

}  // namespace ddl

// x (batch, len, d) and taps (K, nv, d) into y (batch, len, nv, d); for its backward, the gradients of x and the taps
// for y's, g.
struct Conv {
  int64_t f64, threads;
  const void *g, *x, *taps;
  int64_t batch, len, k, nv, d;
  void *y, *gx, *gtaps;
};

extern "C" void ddl_conv_forward(const void* packed) {
  const auto a = ddl::unpack<Conv>(packed);
  ddl::by_dtype(a.f64, [&](auto zero) {
    using T = decltype(zero);
    ddl::conv_forward_impl<T>(ddl::in<T>(a.x), ddl::in<T>(a.taps), a.batch, a.len, a.k, a.nv, a.d,
                              static_cast<T*>(a.y), int(a.threads));
  });
}

extern "C" void ddl_conv_backward(const void* packed) {
  const auto a = ddl::unpack<Conv>(packed);
  ddl::by_dtype(a.f64, [&](auto zero) {
    using T = decltype(zero);
    ddl::conv_backward_impl<T>(ddl::in<T>(a.g), ddl::in<T>(a.x), ddl::in<T>(a.taps), a.batch, a.len, a.k, a.nv, a.d,
                               static_cast<T*>(a.gx), static_cast<T*>(a.gtaps), int(a.threads));
  });
}

// past (batch, d, K-1), advanced in place; x (batch, d); the weight (K, d, nv), contiguous; y (batch, nv, d).
struct ConvStep {
  int64_t f64, threads;
  void* past;
  const void *x, *weight;
  int64_t batch, k, nv, d;
  void* y;
};

extern "C" void ddl_conv_step(const void* packed) {
  const auto a = ddl::unpack<ConvStep>(packed);
  ddl::by_dtype(a.f64, [&](auto zero) {
    using T = decltype(zero);
    ddl::conv_step_impl<T>(static_cast<T*>(a.past), ddl::in<T>(a.x), ddl::in<T>(a.weight), a.batch, a.k, a.nv, a.d,
                           static_cast<T*>(a.y), int(a.threads));
  });
}
