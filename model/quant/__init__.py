"""Packed weights for the CPU backend: one class per scheme (strips.py), their packing (pack.py)
and their multiply (matmul.py, over gemv.py and blas.py), per what the CPU has (cpu.py)."""
