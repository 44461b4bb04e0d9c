"""The readout of the expanded state (TC; CC with one tap) and a decoding step's window step: C++ for CPU
(readout.cpp, cpu.py), Triton for CUDA (triton.py)."""
