"""The residual seam: C++ for CPU (residual.cpp, cpu.py); the seam and the delta update alone in Triton for CUDA
(triton.py)."""
