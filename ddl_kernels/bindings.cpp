// The one extension module of ddl_kernels' CPU kernels: each operation's functions, defined in <op>/<op>.cpp.
#include <torch/extension.h>

#include <vector>

namespace ddl {
std::vector<at::Tensor> residual_forward(const at::Tensor& x, const at::Tensor& h, const at::Tensor& c,
                                         const at::Tensor& u, const at::Tensor& wb, const at::Tensor& bb,
                                         const at::Tensor& wv, const at::Tensor& bv, double scale, double eps,
                                         bool erase, bool save, const at::Tensor& wr);
std::vector<at::Tensor> residual_backward(const at::Tensor& g, const at::Tensor& x, const at::Tensor& h,
                                          const at::Tensor& c, const at::Tensor& u, const at::Tensor& wb,
                                          const at::Tensor& wv, const at::Tensor& stats, double scale, bool erase,
                                          int64_t u_kind, const at::Tensor& gy, const at::Tensor& wr);
at::Tensor readout_forward(const at::Tensor& x, const at::Tensor& taps);
std::vector<at::Tensor> readout_backward(const at::Tensor& g, const at::Tensor& x, const at::Tensor& taps);
at::Tensor window_step(at::Tensor& past, const at::Tensor& state, const at::Tensor& weight);
at::Tensor conv_forward(const at::Tensor& x, const at::Tensor& taps);
std::vector<at::Tensor> conv_backward(const at::Tensor& g, const at::Tensor& x, const at::Tensor& taps);
at::Tensor conv_step(at::Tensor& past, const at::Tensor& embeds, const at::Tensor& weight);
}  // namespace ddl

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("residual_forward", &ddl::residual_forward,
        "the residual seam: X_next, what backward needs, the next readout, the write's coefficients");
  m.def("residual_backward", &ddl::residual_backward, "the residual seam's gradients");
  m.def("readout_forward", &ddl::readout_forward, "the TC readout (CC: one tap)");
  m.def("readout_backward", &ddl::readout_backward, "the readout's gradients");
  m.def("window_step", &ddl::window_step, "one decoding step's readout of the cached window, advanced in place");
  m.def("conv_forward", &ddl::conv_forward, "EC");
  m.def("conv_backward", &ddl::conv_backward, "EC's gradients");
  m.def("conv_step", &ddl::conv_step, "one decoding step's EC from the cached window, advanced in place");
}
