"""Expert compute: the grouped matmul the experts run on expert-major rows
(grouped_gemm.py; its Hopper kernels in hopper_gemm.py)."""
