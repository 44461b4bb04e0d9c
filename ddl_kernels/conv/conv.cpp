// EC, the embedding convolution into the expanded state, and its backward (ddl_kernels/conv).
#include "common.h"

namespace ddl {

// EC, the transpose of the TC readout: y[t, j, i] = sum_s taps[s, j, i] x[t - (K-1) + s, i], zero before token 0,
// from x (B, T, d) to the state (B, T, d_v, d); each state row written once.
template <typename T>
void conv_forward_impl(const T* x, const T* taps, int64_t batch, int64_t len, int64_t k, int64_t nv, int64_t d, T* y) {
  at::parallel_for(0, batch * len, 16, [&](int64_t begin, int64_t end) {
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
                        int64_t d, T* gx, T* gtaps) {
  const auto total = sum_over_tokens<T>(batch * len, k * nv * d, [&](int64_t bt, T* partial) {  // the tap gradients
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

at::Tensor conv_forward(const at::Tensor& x, const at::Tensor& taps) {
  const int64_t batch = x.size(0), len = x.size(1), d = x.size(2), k = taps.size(0), nv = taps.size(1);
  TORCH_CHECK(x.dim() == 3 && x.is_contiguous() && taps.dim() == 3 && taps.size(2) == d && taps.is_contiguous(),
              "ddl conv_forward: x must be (B, T, d) and the taps (K, d_v, d), both contiguous");
  auto y = at::empty({batch, len, nv, d}, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "ddl_conv_forward", [&] {
    conv_forward_impl<scalar_t>(x.data_ptr<scalar_t>(), taps.data_ptr<scalar_t>(), batch, len, k, nv, d,
                                y.data_ptr<scalar_t>());
  });
  return y;
}

std::vector<at::Tensor> conv_backward(const at::Tensor& g, const at::Tensor& x, const at::Tensor& taps) {
  const int64_t batch = x.size(0), len = x.size(1), d = x.size(2), k = taps.size(0), nv = taps.size(1);
  TORCH_CHECK(x.is_contiguous() && taps.is_contiguous() && g.is_contiguous() && g.numel() == batch * len * nv * d,
              "ddl conv_backward: the gradient must be (B, T, d_v, d), all contiguous");
  auto gx = at::empty_like(x), gtaps = at::empty_like(taps);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "ddl_conv_backward", [&] {
    conv_backward_impl<scalar_t>(g.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), taps.data_ptr<scalar_t>(), batch, len,
                                 k, nv, d, gx.data_ptr<scalar_t>(), gtaps.data_ptr<scalar_t>());
  });
  return {gx, gtaps};
}

// One decoding step of EC from the cache's window, advanced in place: past (B, d, K-1) holds the K-1 embeddings
// before the new one x (its embedding (B, 1, d)), time last; the weight is the model's (K, d, d_v).
// y[b, j, i] = sum_s w[s, i, j] window[b, i, s] summed in tap order (to rounding what conv_forward gives: it may
// vectorise its sums), then past drops its oldest embedding and takes x.
template <typename T>
void conv_step_impl(T* past, const T* x, const T* w, int64_t batch, int64_t k, int64_t nv, int64_t d, T* y) {
  const int64_t kp = k - 1;
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
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

at::Tensor conv_step(at::Tensor& past, const at::Tensor& embeds, const at::Tensor& weight) {
  const auto x = embeds.contiguous();
  TORCH_CHECK(past.dim() == 3 && x.dim() == 3 && x.size(1) == 1 && weight.dim() == 3 && past.is_contiguous() &&
                  weight.is_contiguous(),
              "ddl conv_step: the past must be (B, d, K-1), the input (B, 1, d) and the weight (K, d, d_v), the past "
              "and the weight contiguous");
  const int64_t batch = past.size(0), k = weight.size(0), d = weight.size(1), nv = weight.size(2);
  TORCH_CHECK(k > 1 && past.size(1) == d && past.size(2) == k - 1 && x.size(0) == batch && x.size(2) == d,
              "ddl conv_step: the past must be (B, d, K-1) and the input (B, 1, d), K > 1");
  auto y = at::empty({batch, 1, nv, d}, x.options());
  AT_DISPATCH_FLOATING_TYPES(past.scalar_type(), "ddl_conv_step", [&] {
    conv_step_impl<scalar_t>(past.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), batch, k,
                             nv, d, y.data_ptr<scalar_t>());
  });
  return y;
}

}  // namespace ddl
