"""The C++ source of `ddl.cpu_kernels`, compiled on first use by `torch.utils.cpp_extension.load_inline`.

It lives in a Python module, not a `.cpp` file, because a saved checkpoint ships only the `.py` files that its
modeling file reaches by relative imports: the source must travel with the model for remote code to build it.
The functions and the equations they implement are documented in `ddl.cpu_kernels`.
"""

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <mutex>
#include <vector>

namespace {

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
std::vector<double> sum_over_tokens(int64_t n, int64_t width, const Body& body) {
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

// out[j] = a . m[j] for the rows of m (stride d). With R > 0 rows known at compile time, one pass over a and m
// with R sums, each in two vectors' width of lanes (independent chains, added at the end); R = 0: `rows` at run
// time, one row at a time.
template <typename T, int R>
inline void row_dots(const T* a, const T* m, int64_t d, int64_t rows, T* out) {
  if (R == 0) {
    for (int64_t j = 0; j < rows; ++j) row_dots<T, 1>(a, m + j * d, d, 1, out + j);
    return;
  }
  constexpr int L = 64 / sizeof(T), N = R > 0 ? R : 1;
  T lanes[N][L] = {};
  int64_t i = 0;
  for (; i + L <= d; i += L)
    for (int j = 0; j < N; ++j)
      for (int l = 0; l < L; ++l) lanes[j][l] += a[i + l] * m[j * d + i + l];
  for (int j = 0; j < N; ++j) {
    T sum = 0;
    for (int64_t k = i; k < d; ++k) sum += a[k] * m[j * d + k];
    for (int l = 0; l < L; ++l) sum += lanes[j][l];
    out[j] = sum;
  }
}

// u_kind: 0 = u is its own tensor, 1 = u is c (value from the normalised input), 2 = u is the d_v = 1 state X.
// NV: d_v when it is 1, 2, 4 or 8 (compiled for each: a token's d_v rows go through each loop together), or 0:
// d_v = nv at run time.
template <typename T, int NV>
void seam_forward(const T* x, const T* h, const T* c, const T* u, const T* wb, T bb, const T* wv, const T* bv,
                  double scale, double eps, bool erase, int64_t n, int64_t nv, int64_t d, T* out, T* beta_out,
                  T* v_out, T* s_out, T* hx_out) {
  const int64_t rows = NV > 0 ? NV : nv;
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    std::vector<T> coef(rows), ys(rows), hxs(rows, T(0));
    for (int64_t t = begin; t < end; ++t) {
      const T* xt = x + t * rows * d; const T* ht = h + t * d; const T* ct = c + t * d; const T* ut = u + t * d;
      T z, hh;
      row_dots<T, 1>(ct, wb, d, 1, &z);
      row_dots<T, 1>(ht, ht, d, 1, &hh);
      row_dots<T, NV>(ut, wv, d, rows, ys.data());
      if (erase) row_dots<T, NV>(ht, xt, d, rows, hxs.data());
      const T beta = T(2) / (T(1) + std::exp(-(z + bb)));
      const T s = T(1) / std::sqrt(hh + T(eps * eps));
      for (int64_t j = 0; j < rows; ++j) {
        const T y = ys[j] + bv[j], hx = hxs[j];
        const T v = scale > 0 ? T(scale) / (T(1) + std::exp(-y)) : y;
        coef[j] = beta * s * (v - s * hx);
        if (v_out) { v_out[t * rows + j] = v; hx_out[t * rows + j] = hx; }
      }
      if (beta_out) { beta_out[t] = beta; s_out[t] = s; }
      T* ot = out + t * rows * d;
      for (int64_t j = 0; j < rows; ++j) {
        const T* xj = xt + j * d; T* oj = ot + j * d; const T cj = coef[j];
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) oj[i] = xj[i] + ht[i] * cj;
      }
    }
  });
}

template <typename T, int NV>
void seam_backward(const T* g, const T* x, const T* h, const T* c, const T* u, const T* wb, const T* wv,
                   const T* beta_s, const T* v_s, const T* s_s, const T* hx_s, double scale, bool erase, int64_t u_kind,
                   int64_t n, int64_t nv, int64_t d, T* gx, T* gh, T* gc, T* gu, T* gwb, T* gbb, T* gwv, T* gbv) {
  const int64_t rows = NV > 0 ? NV : nv;
  const int64_t width = d + 1 + rows * d + rows;  // the weight gradients: dw, db, dW_v, db_v
  const auto total = sum_over_tokens<T>(n, width, [&](int64_t t, T* partial) {
    T* awb = partial; T* awv = awb + d + 1;
    thread_local std::vector<T> scratch;  // per-token numbers of each row (one buffer per thread, kept)
    scratch.resize(4 * rows);
    T* b = scratch.data(); T* a_g = b + rows; T* a_x = a_g + rows; T* dy = a_x + rows;
    const T* gt = g + t * rows * d; const T* xt = x + t * rows * d; const T* ht = h + t * d;
    const T* ct = c + t * d; const T* ut = u + t * d;
    const T beta = beta_s[t], s = s_s[t];
    row_dots<T, NV>(ht, gt, d, rows, b);
    T dbeta = 0, h_dot = 0;
    for (int64_t j = 0; j < rows; ++j) {
      const T v = v_s[t * rows + j], hx = erase ? hx_s[t * rows + j] : T(0);
      const T tj = v - s * hx, cj = s * b[j];
      dbeta += cj * tj;
      h_dot += b[j] * tj - hx * cj;
      a_g[j] = s * beta * tj;                      // dh += G_j a_g
      a_x[j] = erase ? s * beta * cj : T(0);       // dh -= X_j a_x,  dX_j = G_j - h a_x
      const T dv = beta * cj;
      dy[j] = scale > 0 ? dv * v * (T(1) - v / T(scale)) : dv;
    }
    const T a_h = s * s * s * beta * h_dot;       // dh -= h a_h
    const T dz = dbeta * beta * (T(1) - beta / T(2));
    T* ght = gh + t * d; T* gxt = gx + t * rows * d; T* gct = gc + t * d;
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) { ght[i] = -ht[i] * a_h; gct[i] = dz * wb[i]; awb[i] += dz * ct[i]; }
    // the value's input gradient: into dc (u = c), dX (u = the d_v = 1 state) or its own tensor
    T* gut = u_kind == 1 ? gct : (u_kind == 2 ? gxt : gu + t * d);
    if (u_kind == 0) for (int64_t i = 0; i < d; ++i) gut[i] = 0;
    for (int64_t j = 0; j < rows; ++j) {
      const T* gj = gt + j * d; const T* xj = xt + j * d; T* gxj = gxt + j * d;
      const T agj = a_g[j], axj = a_x[j];
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) {
        ght[i] += gj[i] * agj - xj[i] * axj;
        gxj[i] = gj[i] - ht[i] * axj;
      }
    }
    for (int64_t j = 0; j < rows; ++j) {
      const T* wj = wv + j * d; T* awj = awv + j * d; const T dyj = dy[j];
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) { gut[i] += dyj * wj[i]; awj[i] += dyj * ut[i]; }
    }
    awb[d] += dz;
    for (int64_t j = 0; j < rows; ++j) awv[rows * d + j] += dy[j];
  });
  for (int64_t k = 0; k < width; ++k) {
    T* dst = k < d ? gwb + k
                   : (k == d ? gbb : (k < d + 1 + rows * d ? gwv + (k - d - 1) : gbv + (k - d - 1 - rows * d)));
    *dst = T(total[k]);
  }
}

// Runs kernel<NV> for d_v = nv: compiled for 1, 2, 4 and 8, any other at run time.
#define DDL_BY_ROWS(nv, kernel, ...)            \
  switch (nv) {                                 \
    case 1: kernel<scalar_t, 1>(__VA_ARGS__); break; \
    case 2: kernel<scalar_t, 2>(__VA_ARGS__); break; \
    case 4: kernel<scalar_t, 4>(__VA_ARGS__); break; \
    case 8: kernel<scalar_t, 8>(__VA_ARGS__); break; \
    default: kernel<scalar_t, 0>(__VA_ARGS__);  \
  }

std::vector<at::Tensor> residual_forward(const at::Tensor& x, const at::Tensor& h, const at::Tensor& c,
                                         const at::Tensor& u, const at::Tensor& wb, const at::Tensor& bb,
                                         const at::Tensor& wv, const at::Tensor& bv, double scale, double eps,
                                         bool erase, bool save, const at::Tensor& buffer) {
  const int64_t d = h.size(-1), n = h.numel() / d, nv = wv.size(0);
  TORCH_CHECK(x.numel() == n * nv * d && c.numel() == n * d && u.numel() == n * d && wb.numel() == d &&
              bb.numel() == 1 && wv.size(1) == d && bv.numel() == nv, "ddl residual_forward: mismatched shapes");
  // X_next goes into `buffer` when it is given (a dead state's memory, same shape, not x's): else a new tensor
  const bool into_buffer = buffer.numel() == x.numel() && buffer.sizes() == x.sizes() && buffer.is_contiguous() &&
                           buffer.scalar_type() == x.scalar_type() && buffer.data_ptr() != x.data_ptr();
  auto out = into_buffer ? buffer : at::empty_like(x);
  at::Tensor stats;  // None when nothing is saved (inference)
  if (save) stats = at::empty({n * (2 + 2 * nv)}, h.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "ddl_residual_forward", [&] {
    scalar_t* st = save ? stats.data_ptr<scalar_t>() : nullptr;
    DDL_BY_ROWS(nv, seam_forward, x.data_ptr<scalar_t>(), h.data_ptr<scalar_t>(), c.data_ptr<scalar_t>(),
                u.data_ptr<scalar_t>(), wb.data_ptr<scalar_t>(), *bb.data_ptr<scalar_t>(), wv.data_ptr<scalar_t>(),
                bv.data_ptr<scalar_t>(), scale, eps, erase, n, nv, d, out.data_ptr<scalar_t>(),
                save ? st : nullptr, save ? st + 2 * n : nullptr, save ? st + n : nullptr,
                save ? st + 2 * n + n * nv : nullptr);
  });
  return {out, stats};
}

std::vector<at::Tensor> residual_backward(const at::Tensor& g, const at::Tensor& x, const at::Tensor& h,
                                          const at::Tensor& c, const at::Tensor& u, const at::Tensor& wb,
                                          const at::Tensor& wv, const at::Tensor& stats, double scale, bool erase,
                                          int64_t u_kind) {
  const int64_t d = h.size(-1), n = h.numel() / d, nv = wv.size(0);
  TORCH_CHECK(g.numel() == x.numel() && x.numel() == n * nv * d && stats.numel() == n * (2 + 2 * nv),
              "ddl residual_backward: mismatched shapes");
  auto gx = at::empty_like(x), gh = at::empty_like(h), gc = at::empty_like(c);
  auto gu = u_kind == 0 ? at::empty_like(u) : at::empty({0}, u.options());
  auto gwb = at::empty_like(wb), gbb = at::empty({1}, wb.options()), gwv = at::empty_like(wv);
  auto gbv = at::empty({nv}, wv.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "ddl_residual_backward", [&] {
    const scalar_t* st = stats.data_ptr<scalar_t>();
    DDL_BY_ROWS(nv, seam_backward, g.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), h.data_ptr<scalar_t>(),
                c.data_ptr<scalar_t>(), u.data_ptr<scalar_t>(), wb.data_ptr<scalar_t>(), wv.data_ptr<scalar_t>(), st,
                st + 2 * n, st + n, st + 2 * n + n * nv, scale, erase, u_kind, n, nv, d, gx.data_ptr<scalar_t>(),
                gh.data_ptr<scalar_t>(), gc.data_ptr<scalar_t>(), u_kind == 0 ? gu.data_ptr<scalar_t>() : nullptr,
                gwb.data_ptr<scalar_t>(), gbb.data_ptr<scalar_t>(), gwv.data_ptr<scalar_t>(),
                gbv.data_ptr<scalar_t>());
  });
  return {gx, gh, gc, gu, gwb, gbb, gwv, gbv};
}


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

// One decoding step of the TC readout from its window where the cache holds it, time last: w (B, d_v*d, K) and
// taps (d_v, d, K) in the same layout; y[b, i] = sum_j sum_s taps[j, i, s] w[b, j*d + i, s].
template <typename T>
void window_readout_impl(const T* w, const T* taps, int64_t batch, int64_t nv, int64_t d, int64_t k, T* y) {
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const T* wb = w + b * nv * d * k; T* yb = y + b * d;
      for (int64_t i = 0; i < d; ++i) yb[i] = 0;
      for (int64_t j = 0; j < nv; ++j) {
        const T* wj = wb + j * d * k; const T* tj = taps + j * d * k;
        for (int64_t i = 0; i < d; ++i) {
          T acc = 0;
          for (int64_t s = 0; s < k; ++s) acc += wj[i * k + s] * tj[i * k + s];
          yb[i] += acc;
        }
      }
    }
  });
}

at::Tensor window_readout(const at::Tensor& w, const at::Tensor& taps) {
  TORCH_CHECK(w.dim() == 3 && taps.dim() == 3 && w.is_contiguous() && taps.is_contiguous(),
              "ddl window_readout: the window must be (B, d_v*d, K) and the taps (d_v, d, K), both contiguous");
  const int64_t batch = w.size(0), nv = taps.size(0), d = taps.size(1), k = taps.size(2);
  TORCH_CHECK(w.size(1) == nv * d && w.size(2) == k, "ddl window_readout: the window must be (B, d_v*d, K)");
  auto y = at::empty({batch, d}, w.options());
  AT_DISPATCH_FLOATING_TYPES(w.scalar_type(), "ddl_window_readout", [&] {
    window_readout_impl<scalar_t>(w.data_ptr<scalar_t>(), taps.data_ptr<scalar_t>(), batch, nv, d, k,
                                  y.data_ptr<scalar_t>());
  });
  return y;
}

}  // namespace
"""

__all__ = ["SOURCE"]
