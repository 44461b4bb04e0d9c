"""EC, the embedding convolution into the expanded state: C++ for CPU (conv.cpp, cpu.py), Triton for CUDA
(triton.py, the readout's kernels run the other way)."""
