"""Array backends: host (NumPy and buffer-protocol objects), devices (CuPy), CUDA detection, DLPack."""
