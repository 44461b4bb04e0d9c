r"""EC in Triton for CUDA: the readout's kernels (ddl_kernels/readout/triton.py) run the other way, from d-vectors
to (d_v x d) tiles, and a decoding step's from the cached embeddings. Serves `reference.causal_token_conv` without
history (x `(B, T, d)`, taps `(K, d_v, d)`) and `kernels.conv_step` for eager CUDA tensors other than fp64; opt-in
(`ddl_implementation="triton"`)."""

from .. import Implementation, fallible
from ..readout.triton import conv_step, serves, step_serves, token_window


CONV = Implementation("Triton EC", ("triton",), serves,
                      fallible("Triton EC", lambda x, taps: token_window(x, taps, read=False)))
STEP = Implementation("Triton EC step", ("triton",), step_serves, fallible("Triton EC step", conv_step))

__all__ = ["CONV", "STEP"]
