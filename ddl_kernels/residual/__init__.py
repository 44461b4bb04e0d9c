"""The residual seam: C++ for CPU (residual.cpp, cpu.py), the delta update in Triton for CUDA (triton.py)."""
