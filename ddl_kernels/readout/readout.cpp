// The TC readout of the expanded state (CC: one tap), its backward, and a decoding step's readout of the cache's
// window, advanced in place (ddl_kernels/readout).
#include "common.h"

namespace ddl {

// The TC readout (CC: one tap): y[t, i] = sum_s sum_j taps[s, j, i] X[t - (K-1) + s, j, i], zero before token 0.
template <typename T>
void readout_forward_impl(const T* x, const T* taps, int64_t batch, int64_t len, int64_t k, int64_t nv, int64_t d,
                          T* y) {
  at::parallel_for(0, batch * len, 16, [&](int64_t begin, int64_t end) {
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
                           int64_t d, T* gx, T* gtaps) {
  const auto total = sum_over_tokens<T>(batch * len, k * nv * d, [&](int64_t bt, T* partial) {  // the tap gradients
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

at::Tensor readout_forward(const at::Tensor& x, const at::Tensor& taps) {
  const int64_t batch = x.size(0), len = x.size(1), nv = x.size(2), d = x.size(3), k = taps.size(0);
  TORCH_CHECK(taps.size(1) == nv && taps.size(2) == d, "ddl readout_forward: taps must be (K, d_v, d)");
  auto y = at::empty({batch, len, d}, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "ddl_readout_forward", [&] {
    readout_forward_impl<scalar_t>(x.data_ptr<scalar_t>(), taps.data_ptr<scalar_t>(), batch, len, k, nv, d,
                                   y.data_ptr<scalar_t>());
  });
  return y;
}

std::vector<at::Tensor> readout_backward(const at::Tensor& g, const at::Tensor& x, const at::Tensor& taps) {
  const int64_t batch = x.size(0), len = x.size(1), nv = x.size(2), d = x.size(3), k = taps.size(0);
  TORCH_CHECK(taps.size(1) == nv && taps.size(2) == d && g.numel() == batch * len * d,
              "ddl readout_backward: taps must be (K, d_v, d) and the gradient (B, T, d)");
  auto gx = at::empty_like(x), gtaps = at::empty_like(taps);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "ddl_readout_backward", [&] {
    readout_backward_impl<scalar_t>(g.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), taps.data_ptr<scalar_t>(), batch,
                                    len, k, nv, d, gx.data_ptr<scalar_t>(), gtaps.data_ptr<scalar_t>());
  });
  return {gx, gtaps};
}

// One decoding step of the TC readout from the cache's window, advanced in place: past (B, d_v*d, K-1) holds the K-1
// inputs before the new one x (its state (B, 1, d_v, d), read as (B, d_v*d)), channel j*d + i, time last; taps
// (d_v, d, K) in the same layout.
// y[b, i] = sum_j (sum_{s < K-1} taps[j, i, s] past[b, j*d + i, s] + taps[j, i, K-1] x[b, j*d + i]), then past drops
// its oldest input and takes x (the window a full readout would read, summed in its order).
// KP = K-1 when it is 1-7 (compiled for each: the window's loops unrolled, its rows vectorised), or 0: K-1 at run time.
template <typename T, int KP>
void window_step_impl(T* past, const T* x, const T* taps, int64_t batch, int64_t nv, int64_t d, int64_t k, T* y) {
  const int64_t kp = KP > 0 ? KP : k - 1;
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
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

at::Tensor window_step(at::Tensor& past, const at::Tensor& state, const at::Tensor& weight) {
  TORCH_CHECK(past.dim() == 3 && state.dim() == 4 && state.size(1) == 1 && weight.dim() == 3 && past.is_contiguous(),
              "ddl window_step: the past must be (B, d_v*d, K-1) and contiguous, the state (B, 1, d_v, d), the weight "
              "(K, d, d_v)");
  // the weight as the model keeps it for a decoding run is a view of taps (d_v, d, K): no copy then
  const auto taps = weight.permute({2, 1, 0}).contiguous();
  const auto x = state.contiguous();
  const int64_t batch = past.size(0), nv = taps.size(0), d = taps.size(1), k = taps.size(2);
  TORCH_CHECK(k > 1 && past.size(1) == nv * d && past.size(2) == k - 1 && x.size(0) == batch && x.size(2) == nv &&
                  x.size(3) == d,
              "ddl window_step: for a weight (K, d, d_v) with K > 1, the past must be (B, d_v*d, K-1) and the state "
              "(B, 1, d_v, d)");
  auto y = at::empty({batch, 1, d}, x.options());
  AT_DISPATCH_FLOATING_TYPES(past.scalar_type(), "ddl_window_step", [&] {
    auto run = [&](auto kp) {
      window_step_impl<scalar_t, decltype(kp)::value>(past.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(),
                                                      taps.data_ptr<scalar_t>(), batch, nv, d, k, y.data_ptr<scalar_t>());
    };
    switch (k - 1) {
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
  return y;
}

}  // namespace ddl
