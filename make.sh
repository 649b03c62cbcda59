#!/bin/sh
# The README's two set-up commands on a machine that has nothing but the source tree:
#   sh make.sh rehearse   |   sh make.sh test
# A fresh Debian 12 has no make; as root this installs it (and nothing else) from the
# machine's own apt sources, then hands over to the Makefile, which installs the rest.
#
# As root, the daemon and a rehearsal refuse any file or directory another user could have
# written (config/trust.py: each directory from / down, like sshd's StrictModes). A tree
# unpacked as root from a tarball or `git archive` keeps the archive's modes, often 0664 and
# 0775 (group-writable), and was refused one directory at a time, after 78 s of installing.
# So, first and as root: group and other write permission come off this tree (its own files
# only, never .git), said in one line; directories above it that others may write are named,
# all of them, with the one command that fixes them, and nothing is installed (exit 2). A tree
# that is not root's, or lies below a directory of another user, is not touched: it is named,
# with the way out (copy it to a directory of root's, or run as its owner), exit 2. Those two
# refusals are the rehearsal's (it runs the daemon as root on this tree's configuration); for
# any other target (`test`: the suite makes its own configuration) they are warnings.
set -eu
cd "$(dirname "$0")"
here=$(pwd -P)

if [ "$(id -u)" = 0 ]; then
    # the tree and every directory above it: another user's, or writable by others (a sticky
    # directory of root's such as /tmp is fine, as for the daemon)
    theirs=""
    loose_above=""
    dir=$here
    while :; do
        if [ "$(stat -c %u "$dir")" != 0 ]; then
            theirs="$theirs $dir ($(stat -c %U "$dir"))"
        elif [ "$dir" != "$here" ] && [ -n "$(find "$dir" -maxdepth 0 -perm /022 ! -perm -1000 -print)" ]; then
            loose_above="$loose_above $dir"
        fi
        [ "$dir" != / ] || break
        dir=$(dirname "$dir")
    done
    # the refusals stop the rehearsal only: `sh make.sh test` from a checkout anywhere still runs
    refuse=2
    case "${1:-}" in rehearse*) ;; *) refuse=0 ;; esac
    if [ -n "$theirs" ]; then
        echo "make.sh: as root the daemon refuses what another user could change, and these are not root's:$theirs;" \
             "copy the tree to a directory of root's (cp -a $here /root/) or run make.sh as its owner" >&2
        [ "$refuse" = 0 ] || exit "$refuse"
    fi
    loose=$(find . -path ./.git -prune -o ! -type l -perm /022 -print | wc -l)
    if [ "$loose" -gt 0 ] && [ -z "$theirs" ]; then  # another user's tree is never touched
        find . -path ./.git -prune -o ! -type l -perm /022 -exec chmod go-w {} +
        echo "make.sh: $here: took group and other write permission off $loose files and directories" \
             "(chmod -R go-w): as root the daemon refuses anything another user could have written"
    fi
    if [ -n "$loose_above" ]; then
        echo "make.sh: directories above $here that a user other than root may write, so as root the daemon" \
             "would refuse everything below them:$loose_above; fix them all with: chmod go-w$loose_above" >&2
        [ "$refuse" = 0 ] || exit "$refuse"
    fi
    strangers=$(find . -path ./.git -prune -o ! -user root -print | head -n 3)
    [ -z "$strangers" ] || echo "make.sh: warning: files in $here that are not root's (e.g. $(echo $strangers)):" \
                                "as root the daemon refuses them; fix them all with: chown -R root:root $here" >&2
fi

if ! command -v make >/dev/null 2>&1; then
    if [ "$(id -u)" != 0 ]; then
        echo "make.sh: make is not installed; run this as root (it installs make with apt-get), or install make yourself" >&2
        exit 2
    fi
    echo "make.sh: installing make (apt-get install make)"
    sh tests/rig/install_quietly.sh make
fi
exec make --no-print-directory "$@"
