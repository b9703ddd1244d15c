"""Which implementation runs each kernel: the native runtime (CPU or CUDA) or pure torch."""

from __future__ import annotations

from kite.kernels import native

KERNELS = ("quantize_groups", "dequantize_groups", "lloyd_cosine", "eigh_desc", "pca_coefs", "pca_finish")
_CUDA_KERNELS = {"quantize_groups", "lloyd_cosine", "eigh_desc", "pca_coefs", "pca_finish"}
_CUDA_ONLY = {"pca_coefs", "pca_finish"}  # the split load: torch on the CPU


def backend(device: str = "cpu") -> str:
    """``"native-cpu"``, ``"native-cuda"`` or ``"torch"`` for kernels on ``device``."""
    if str(device).startswith("cuda"):
        return "native-cuda" if native.cuda() is not None else "torch"
    return "native-cpu" if native.cpu() is not None else "torch"


def backends(device: str = "cpu") -> dict[str, str]:
    """Per kernel: what runs on ``device`` (CUDA has no dequantize kernel: pca_coefs dequantizes)."""
    b = backend(device)
    if b == "native-cuda":
        return {k: (b if k in _CUDA_KERNELS else "torch") for k in KERNELS}
    return {k: ("torch" if k in _CUDA_ONLY else b) for k in KERNELS}
