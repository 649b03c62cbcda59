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
CuTe DSL (a hard dependency of 0.5.23: FlashAttention-4, FlashInfer paths) caches its JIT under
CUTE_DSL_CACHE_DIR, else under $TMPDIR (`cache_helpers.py:66-82`), which we empty at every start.

The Hugging Face hub is not a compile cache: it holds downloaded models and the user's token
(HF_HOME, else $XDG_CACHE_HOME/huggingface). Our XDG_CACHE_HOME would move it, so a
`model_path` given as a hub id would download again, or fail on a gated model for want of the
token. HF_HOME is pinned to where the user's own hub is (~/.cache/huggingface) when the user
has a home; a system user without one (the package's `sglang`, home /nonexistent) gets a hub in
its persistent cache instead. A profile's own `env` (HF_HOME, HF_TOKEN_PATH, HF_HUB_CACHE) wins.
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
    ("CUTE_DSL_CACHE_DIR", "sglang/cute_dsl"),
)


def cache_environment(root: Path, home: str | None = None) -> list[tuple[str, str]]:
    """The variables for a server whose caches live under `root`, its user's home being `home`."""
    env = [(name, str(root / sub) if sub else str(root)) for name, sub in CACHE_VARIABLES]
    return env + [("HF_HOME", hub_home(root, home))]


def hub_home(root: Path, home: str | None) -> str:
    """Where the user's Hugging Face hub and token already are: ~/.cache/huggingface with a
    real home directory, else a hub of its own in the persistent cache."""
    if home and home != "/nonexistent" and Path(home).is_dir():
        return str(Path(home) / ".cache" / "huggingface")
    return str(root / "huggingface")
