"""Where SGLang's compilers keep their caches, and the variables that move them.

A large model's start compiles kernels for minutes (Triton, torch inductor, FlashInfer's,
DeepGEMM's and SGLang's own JIT, CUDA's PTX JIT). Each caches under $HOME, $XDG_CACHE_HOME or
/tmp by default: with root's HOME, an unwritable home of a system user, or a private TMPDIR
emptied at every stop, each restart would compile again. The supervisor gives every server a
persistent cache directory of its user and points each compiler at a part of it.

Read from SGLang 0.5.23 (environ.py `redirect_third_party_caches`, which only *defaults* these
to `$SGLANG_CACHE_DIR`, so what we set wins) and the libraries it pins: DeepGEMM's cache is
forced from SGLANG_DG_CACHE_DIR (DG_JIT_CACHE_DIR alone is overwritten), SGLang's JIT kernels
do not follow SGLANG_CACHE_DIR, and tvm-ffi and outlines follow neither it nor XDG_CACHE_HOME.
"""

from __future__ import annotations

from pathlib import Path

#: variable -> path under the user's cache root, laid out as SGLang would under ~/.cache
CACHE_VARIABLES: tuple[tuple[str, str], ...] = (
    ("XDG_CACHE_HOME", ""),  # torch extensions (and xgrammar's kernel), the HF hub when HF_HOME is unset
    ("SGLANG_CACHE_DIR", "sglang"),
    ("TRITON_CACHE_DIR", "sglang/triton"),
    ("TORCHINDUCTOR_CACHE_DIR", "sglang/inductor"),
    ("CUDA_CACHE_PATH", "sglang/nv"),
    ("TILELANG_CACHE_DIR", "sglang/tilelang"),
    ("FLASHINFER_WORKSPACE_BASE", "sglang"),  # FlashInfer caches under <base>/.cache/flashinfer
    ("SGLANG_DG_CACHE_DIR", "sglang/deep_gemm"),
    ("DG_JIT_CACHE_DIR", "sglang/deep_gemm"),  # DeepGEMM outside SGLang
    ("SGLANG_JIT_CACHE_DIR", "sglang/jit"),
    ("TORCH_EXTENSIONS_DIR", "torch_extensions"),
    ("TVM_FFI_CACHE_DIR", "tvm-ffi"),
    ("OUTLINES_CACHE_DIR", "outlines"),
)


def cache_environment(root: Path) -> list[tuple[str, str]]:
    """The variables for a server whose caches live under `root`."""
    return [(name, str(root / sub) if sub else str(root)) for name, sub in CACHE_VARIABLES]
