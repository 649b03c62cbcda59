#!/bin/sh
# The README's two set-up commands on a machine that has nothing but the source tree:
#   sh make.sh rehearse   |   sh make.sh test
# A fresh Debian 12 has no make; as root this installs it (and nothing else) from the
# machine's own apt sources, then hands over to the Makefile, which installs the rest.
set -eu
cd "$(dirname "$0")"
if ! command -v make >/dev/null 2>&1; then
    if [ "$(id -u)" != 0 ]; then
        echo "make.sh: make is not installed; run this as root (it installs make with apt-get), or install make yourself" >&2
        exit 2
    fi
    echo "make.sh: installing make (apt-get install make)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq make >/dev/null
fi
exec make --no-print-directory "$@"
