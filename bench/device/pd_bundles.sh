#!/usr/bin/env bash
# pd_bundles.sh REPO
#
# The two bundles real_pd.py needs beside shared/real-sglang/prepare.sh's (which stages
# sglang-site and router-site into REPO/.sgl/): the mooncake transfer engine, trimmed, into
# REPO/.sgl/mooncake-site.tar.xz, and smg 1.13.0 into REPO/.sglr/smg-site.tar.xz. Move prepare.sh's
# router-site.tar.xz into REPO/.sglr/ too: .sgl/ (SGLang + mooncake, ~49 MB) and .sglr/ (both
# routers, ~45 MB) then each fit one device call's 64 MiB.
#
# Why trimmed: mooncake-transfer-engine-cuda13 0.3.14 is a 49.7 MB wheel (163 MiB unpacked: the
# store, its master and client, the EP and PG libraries). SGLang's PD transfer needs only
# `from mooncake.engine import TransferEngine`: engine.so and the libraries it links to (found
# here by walking its NEEDED entries inside the wheel): 6.5 MB as xz. The walk once lost its last
# entry (libyaml-cpp) to a `read` without a final newline, and the prefill then failed on the GPU
# machine with "Please install mooncake": the list now ends with a newline, and the import is
# checked against the tree before it is packed (ldd: every library of the wheel found).
set -euo pipefail
REPO=$(cd "${1:?usage: pd_bundles.sh REPO}" && pwd)
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
PLAT=(--only-binary=:all: --no-deps --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64)
python3 -m pip download -q "${PLAT[@]}" -d "$W/wheels" mooncake-transfer-engine-cuda13==0.3.14 smg==1.13.0 setproctitle==1.3.8

# mooncake: engine.so and what it links to inside the wheel
mkdir -p "$W/mc" "$W/mctree/mooncake"
python3 -m zipfile -e "$W"/wheels/mooncake_transfer_engine_cuda13-*.whl "$W/mc"
python3 - "$W/mc" > "$W/keep.txt" <<'PY'
import os, subprocess, sys
base = sys.argv[1]
avail = {f: f"{d}/{f}" for d in ("mooncake", "mooncake_transfer_engine_cuda13.libs") for f in os.listdir(os.path.join(base, d))}
want, todo = {"mooncake/engine.so"}, ["mooncake/engine.so"]
while todo:
    out = subprocess.run(["readelf", "-d", os.path.join(base, todo.pop())], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        if "(NEEDED)" in line:
            name = line.split("[", 1)[1].rstrip("]")
            if name in avail and avail[name] not in want:
                want.add(avail[name]); todo.append(avail[name])
print("\n".join(sorted(want)))
PY
cp "$W"/mc/mooncake/*.py "$W/mctree/mooncake/"
cp -r "$W"/mc/mooncake_transfer_engine_cuda13-*.dist-info "$W/mctree/"
while IFS= read -r f || [ -n "$f" ]; do mkdir -p "$W/mctree/$(dirname "$f")"; cp "$W/mc/$f" "$W/mctree/$f"; done < "$W/keep.txt"
missing=$(cd "$W/mctree/mooncake" && LD_LIBRARY_PATH=. ldd engine.so | grep "not found" | grep -v -E "libcuda|libcudart|libibverbs|libmlx5|libnuma|libcurl" || true)
[ -z "$missing" ] || { echo "pd_bundles.sh: the trimmed mooncake lacks: $missing" >&2; exit 1; }
mkdir -p "$REPO/.sgl" "$REPO/.sglr"
(cd "$W/mctree" && tar cf - . | xz -T2 -6 > "$REPO/.sgl/mooncake-site.tar.xz")

# smg and what its launcher imports that the device lacks (setproctitle)
mkdir -p "$W/smg"
for w in "$W"/wheels/smg-*.whl "$W"/wheels/setproctitle-*.whl; do python3 -m zipfile -e "$w" "$W/smg"; done
rm -rf "$W"/smg/smg-*.dist-info/sboms
(cd "$W/smg" && tar cf - . | xz -T2 -6 > "$REPO/.sglr/smg-site.tar.xz")
ls -l "$REPO/.sgl/mooncake-site.tar.xz" "$REPO/.sglr/smg-site.tar.xz"
