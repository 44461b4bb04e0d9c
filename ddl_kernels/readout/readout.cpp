// The TC readout of the expanded state (CC: one tap), its backward, and a decoding step's readout of the cache's
// window, advanced in place (ddl_kernels/readout).
#include "common.h"

namespace ddl {

// The TC readout (CC: one tap): y[t, i] = sum_s sum_j taps[s, j, i] X[t - (K-1) + s, j, i], zero before token 0.
template <typename T>
void readout_forward_impl(const T* x, const T* taps, int64_t batch, int64_t len, int64_t k, int64_t nv, int64_t d,
                          T* y, int threads) {
  parallel_for(batch * len, 16, threads, [&](int64_t begin, int64_t end) {
    for (int64_t bt = begin; bt < end; ++bt) {
      const int64_t t = bt % len;
      T* yt = y + bt * d;
      for (int64_t i = 0; i < d; ++i) yt[i] = 0;
      for (int64_t s = std::max<int64_t>(0, k - 1 - t); s < k; ++s) {
        const T* xs = x + (bt - (k - 1) + s) * nv * d;
        for (int64_t j = 0; j < nv; ++j) {
          const T* xj = xs + j * d; const T* w = taps + (s * nv + j) * d;
#pragma omp simd
          for (int64_t i = 0; i < d; ++i) yt[i] += w[i] * xj[i];
        }
      }
    }
  });
}

// dX[t, j, i] = sum_s taps[s, j, i] G[t + (K-1) - s, i];  dtaps[s, j, i] = sum_t X[t - (K-1) + s, j, i] G[t, i].
template <typename T>
void readout_backward_impl(const T* g, const T* x, const T* taps, int64_t batch, int64_t len, int64_t k, int64_t nv,
                           int64_t d, T* gx, T* gtaps, int threads) {
  // the tap gradients
  const auto total = sum_over_tokens<T>(batch * len, k * nv * d, threads, [&](int64_t bt, T* partial) {
    const int64_t t = bt % len;
    T* gxt = gx + bt * nv * d; const T* xt = x + bt * nv * d;
    for (int64_t i = 0; i < nv * d; ++i) gxt[i] = 0;
    for (int64_t s = std::max<int64_t>(0, t + k - len); s < k; ++s) {  // output t + (K-1) - s reads t via tap s
      const T* gs = g + (bt + (k - 1) - s) * d;
      for (int64_t j = 0; j < nv; ++j) {
        const T* w = taps + (s * nv + j) * d; T* gxj = gxt + j * d; const T* xj = xt + j * d;
        T* pw = partial + (s * nv + j) * d;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) { gxj[i] += w[i] * gs[i]; pw[i] += xj[i] * gs[i]; }
      }
    }
  });
  for (size_t q = 0; q < total.size(); ++q) gtaps[q] = T(total[q]);
}

// One decoding step of the TC readout from the cache's window, advanced in place: past (B, d_v*d, K-1) holds the K-1
// inputs before the new one x (its state (B, 1, d_v, d), read as (B, d_v*d)), channel j*d + i, time last; taps
// (d_v, d, K) in the same layout.
// y[b, i] = sum_j (sum_{s < K-1} taps[j, i, s] past[b, j*d + i, s] + taps[j, i, K-1] x[b, j*d + i]), then past drops
// its oldest input and takes x (the window a full readout would read, summed in its order).
// KP = K-1 when it is 1-7 (compiled for each: the window's loops unrolled, its rows vectorised), or 0: K-1 at run time.
template <typename T, int KP>
void window_step_impl(T* past, const T* x, const T* taps, int64_t batch, int64_t nv, int64_t d, int64_t k, T* y,
                      int threads) {
  const int64_t kp = KP > 0 ? KP : k - 1;
  parallel_for(batch, 1, threads, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      T* pb = past + b * nv * d * kp; const T* xb = x + b * nv * d; T* yb = y + b * d;
      for (int64_t i = 0; i < d; ++i) yb[i] = 0;
      for (int64_t j = 0; j < nv; ++j) {
        T* pj = pb + j * d * kp; const T* tj = taps + j * d * (kp + 1); const T* xj = xb + j * d;
        for (int64_t i = 0; i < d; ++i) {
          T* p = pj + i * kp; const T* t = tj + i * (kp + 1); const T xc = xj[i];
          T acc = 0;
          for (int64_t s = 0; s < kp; ++s) acc += p[s] * t[s];
          acc += xc * t[kp];
          for (int64_t s = 0; s + 1 < kp; ++s) p[s] = p[s + 1];
          p[kp - 1] = xc;
          yb[i] += acc;
        }
      }
    }
  });
}

}  // namespace ddl

// The state x (batch, len, nv, d) and taps (K, nv, d) into y (batch, len, d); for its backward, the gradients of x
// and the taps for y's, g.
struct Readout {
  int64_t f64, threads;
  const void *g, *x, *taps;
  int64_t batch, len, k, nv, d;
  void *y, *gx, *gtaps;
};

extern "C" void ddl_readout_forward(const void* packed) {
  const auto a = ddl::unpack<Readout>(packed);
  ddl::by_dtype(a.f64, [&](auto zero) {
    using T = decltype(zero);
    ddl::readout_forward_impl<T>(ddl::in<T>(a.x), ddl::in<T>(a.taps), a.batch, a.len, a.k, a.nv, a.d,
                                 static_cast<T*>(a.y), int(a.threads));
  });
}

extern "C" void ddl_readout_backward(const void* packed) {
  const auto a = ddl::unpack<Readout>(packed);
  ddl::by_dtype(a.f64, [&](auto zero) {
    using T = decltype(zero);
    ddl::readout_backward_impl<T>(ddl::in<T>(a.g), ddl::in<T>(a.x), ddl::in<T>(a.taps), a.batch, a.len, a.k, a.nv,
                                  a.d, static_cast<T*>(a.gx), static_cast<T*>(a.gtaps), int(a.threads));
  });
}

// past (batch, nv*d, K-1), advanced in place; x (batch, nv, d); taps (nv, d, K), contiguous; y (batch, d).
struct WindowStep {
  int64_t f64, threads;
  void* past;
  const void *x, *taps;
  int64_t batch, nv, d, k;
  void* y;
};

extern "C" void ddl_window_step(const void* packed) {
  const auto a = ddl::unpack<WindowStep>(packed);
  ddl::by_dtype(a.f64, [&](auto zero) {
    using T = decltype(zero);
    auto run = [&](auto kp) {
      ddl::window_step_impl<T, decltype(kp)::value>(static_cast<T*>(a.past), ddl::in<T>(a.x), ddl::in<T>(a.taps),
                                                    a.batch, a.nv, a.d, a.k, static_cast<T*>(a.y), int(a.threads));
    };
    switch (a.k - 1) {
      case 1: run(std::integral_constant<int, 1>()); break;
      case 2: run(std::integral_constant<int, 2>()); break;
      case 3: run(std::integral_constant<int, 3>()); break;
      case 4: run(std::integral_constant<int, 4>()); break;
      case 5: run(std::integral_constant<int, 5>()); break;
      case 6: run(std::integral_constant<int, 6>()); break;
      case 7: run(std::integral_constant<int, 7>()); break;
      default: run(std::integral_constant<int, 0>());
    }
  });
}
