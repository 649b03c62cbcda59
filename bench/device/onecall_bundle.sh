#!/usr/bin/env bash
# onecall_bundle.sh REPO
#
# Rewrites REPO/.sgl so that ONE device call carries everything the real PD group behind
# sglang-router needs (SGLang, the mooncake transfer engine, the router, the tiny model's
# maker): `real_pd.py unpack && real_pd.py run --mode real --router sglang-router` in a single
# call, instead of two calls that must meet on the same warm machine (its /tmp is kept only
# 30 s after a call). The originals are kept in REPO/.sgl-full/.
#
# What is left out, and why it is safe:
#   - sglang/multimodal_gen (23 MiB: the diffusion server): `launch_server` of a language model
#     never imports it (only sglang/kernels/ops/diffusion, sglang/test and the NPU backend do).
#   - sglang/srt/rust_extensions/_bench*.so (8 MiB): only sglang/benchmark loads it.
#   - the router's symbol table (`strip --strip-unneeded` of sglang_router_rs.abi3.so, 92 -> 72
#     MiB): the same code; only a panic's backtrace loses its function names.
# bench/device/sglang_import_trace.py compares the full and the trimmed bundle's server imports
# on CPU (2026-12-07: the same). Sizes (2026-12-07): sglang-site 42.2 -> 38.3 MB, router-site 19.1 -> 16.6 MB; .sgl 61.6 MB,
# with the 3.6 MB tree 65.2 MB of the 67.1 MB (64 MiB) a call may carry.
set -euo pipefail
REPO=$(cd "${1:?usage: onecall_bundle.sh REPO}" && pwd)
FULL="$REPO/.sgl-full"
[ -d "$FULL" ] || { mkdir -p "$FULL"; cp -a "$REPO/.sgl/." "$FULL/"; }
[ -f "$FULL/sglang-site.tar.xz" ] || { echo "onecall_bundle.sh: $FULL/sglang-site.tar.xz missing" >&2; exit 1; }
ROUTER="$FULL/router-site.tar.xz"
[ -f "$ROUTER" ] || ROUTER="$REPO/.sglr/router-site.tar.xz"
[ -f "$ROUTER" ] || { echo "onecall_bundle.sh: no router-site.tar.xz in $FULL or $REPO/.sglr" >&2; exit 1; }
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT

mkdir "$W/s" "$W/r"
tar -xJf "$FULL/sglang-site.tar.xz" -C "$W/s"
rm -rf "$W/s/sglang/multimodal_gen" "$W"/s/sglang/srt/rust_extensions/_bench*.so
if grep -rlqE --include=*.py "^\s*(from|import) sglang\.multimodal_gen" "$W/s/sglang/srt" "$W/s/sglang/launch_server.py"; then
    echo "onecall_bundle.sh: this SGLang's server imports multimodal_gen; not trimming" >&2; exit 1
fi
tar -xJf "$ROUTER" -C "$W/r"
strip --strip-unneeded "$W"/r/sglang_router/sglang_router_rs*.so

rm -f "$REPO/.sgl/sglang-site.tar.xz" "$REPO/.sgl/router-site.tar.xz"
(cd "$W/s" && tar cf - . | xz -T2 -9 > "$REPO/.sgl/sglang-site.tar.xz")
(cd "$W/r" && tar cf - . | xz -T2 -9e > "$REPO/.sgl/router-site.tar.xz")
cp "$FULL/mooncake-site.tar.xz" "$FULL/make_tiny_model.py" "$REPO/.sgl/"
if [ -f "$FULL/MANIFEST.txt" ]; then
    { cat "$FULL/MANIFEST.txt"; echo "one-call layout $(date -u +%FT%TZ) by bench/device/onecall_bundle.sh:" \
      "sglang/multimodal_gen and rust_extensions/_bench left out; the router's symbols stripped"; } > "$REPO/.sgl/MANIFEST.txt"
fi
(cd "$REPO/.sgl" && sha256sum ./router-site.tar.xz ./sglang-site.tar.xz > SHA256SUMS)
du -cb "$REPO"/.sgl/* | tail -1
