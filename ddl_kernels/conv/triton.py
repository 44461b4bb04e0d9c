r"""EC in Triton for CUDA: the readout's kernels (ddl_kernels/readout/triton.py) run the other way, from d-vectors
to (d_v x d) tiles, and a decoding step's from the cached embeddings. Serves `reference.causal_token_conv` without
history (x `(B, T, d)`, taps `(K, d_v, d)`) and a decoding step's EC (`ddl.ops.conv_step`) for eager CUDA tensors other than fp64; opt-in
(`ddl_implementation="triton"`)."""

from .. import fallible, serving
from ..readout.triton import conv_step, serves, step_serves, token_window


RUN = serving(serves, fallible("Triton EC", lambda x, taps: token_window(x, taps, read=False)))
STEP = serving(step_serves, fallible("Triton EC step", conv_step))

__all__ = ["RUN", "STEP"]
