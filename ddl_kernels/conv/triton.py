r"""EC in Triton for CUDA: the readout's two kernels (ddl_kernels/readout/triton.py) run the other way, from d-vectors
to (d_v x d) tiles. Serves `reference.causal_token_conv` without history (x `(B, T, d)`, taps `(K, d_v, d)`) for CUDA
tensors other than fp64; opt-in (`ddl_implementation="triton"`)."""

from .. import Implementation, fallible
from ..readout.triton import serves, token_window


CONV = Implementation("Triton EC", ("triton",), serves, fallible("Triton EC", lambda x, taps: token_window(x, taps,
                                                                                                            read=False)))

__all__ = ["CONV"]
