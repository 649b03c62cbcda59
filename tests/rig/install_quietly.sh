#!/bin/sh
# Install Debian packages for the set-up, the tests and `make deb`, and leave the host with no
# service of theirs running or enabled (issue #26): the tests start their own etcd and
# prometheus, on addresses they own; debhelper's man-db brings a timer nobody asked for.
#
#   sh tests/rig/install_quietly.sh PACKAGE...        (as root; the Makefile's test-setup)
#
# Debian enables the units a package ships in its postinst (and starts them, unless
# policy-rc.d says no); the packages' Recommends bring more (prometheus -> node exporter and
# its collectors -> smartmontools, nvme-cli, their timers). So the unit links under
# /etc/systemd/system are listed before and after, and every unit that got a link it did not
# have is disabled (stopped too where systemd runs): only what this install enabled, never
# what the machine had before. `systemctl disable` works without a running systemd as well
# (deb-systemd-helper refuses outside dpkg, which left them enabled on such a host).
# INSTALL_ROOT and APT_GET are for its own test (tests/test_install_quietly.py): another root
# directory (systemctl --root) and an apt-get that only does what a postinst does.
set -u
[ "$#" -gt 0 ] || { echo "usage: sh tests/rig/install_quietly.sh PACKAGE..." >&2; exit 2; }
root=${INSTALL_ROOT:-}
apt=${APT_GET:-apt-get}
units=$root/etc/systemd/system
policy=$root/usr/sbin/policy-rc.d
before=$(mktemp)
after=$(mktemp)
ours=
restored=
trap 'rm -f "$before" "$after"' EXIT
find "$units" -type l 2>/dev/null | sort >"$before"

# Another apt may hold its locks meanwhile (unattended-upgrades on a fresh machine, a second
# `make deb`): wait for it, up to APT_LOCK_WAIT seconds, instead of failing at once. apt-get
# waits for dpkg's lock itself (DPkg::Lock::Timeout) but not `update` for the lists' lock: that
# one is retried here, and only that failure.
lock_wait=${APT_LOCK_WAIT:-600}
apt_update() {
    waited=0
    while :; do
        out=$("$apt" update -qq 2>&1) && { [ -z "$out" ] || printf '%s\n' "$out"; return 0; }
        case "$out" in
            *"Could not get lock"* | *"Unable to lock"*) ;;
            *) printf '%s\n' "$out" >&2; return 1 ;;
        esac
        if [ "$waited" -ge "$lock_wait" ]; then
            printf '%s\n' "$out" >&2
            echo "install_quietly: another apt still holds its lock after ${lock_wait} s" >&2
            return 1
        fi
        [ "$waited" -gt 0 ] || echo "install_quietly: another apt holds its lock; waiting for it (up to ${lock_wait} s)" >&2
        sleep 2
        waited=$((waited + 2))
    done
}

restore() {  # once: our policy-rc.d gone, every unit link this install made disabled
    [ -z "$restored" ] || return 0
    restored=1
    [ -z "$ours" ] || rm -f "$policy"
    disable_new
}

disable_new() {
    find "$units" -type l 2>/dev/null | sort >"$after"
    # a link in a .wants/.requires directory is named after its unit; any other (an alias such as
    # etcd2.service or smartd.service) points at it
    enabled=$(comm -13 "$before" "$after" | while read -r link; do
        case "$link" in
            */*.wants/*|*/*.requires/*) basename "$link" ;;
            *) basename "$(readlink "$link")" ;;
        esac
    done | sort -u)
    how=--now
    [ -d /run/systemd/system ] || how=--no-reload  # no systemd running: the links alone
    [ -z "$root" ] || how=--root=$root
    for unit in $enabled; do  # one at a time: a name systemctl does not know must not keep the others enabled
        systemctl disable "$how" "$unit" >/dev/null 2>&1 || echo "install_quietly: could not disable $unit" >&2
    done
    left=$(find "$units" -type l 2>/dev/null | sort | comm -13 "$before" -)
    [ -z "$left" ] || echo "install_quietly: links this install made that are still there:" $left >&2
}

# The host is put back however this ends: a normal end, an error, or INT/TERM/HUP mid-install
# (a policy-rc.d left behind says "exit 101" to every later install: no service would start).
# A signal waits for the command in the foreground (apt) to end, then runs restore and exits.
trap 'restore; rm -f "$before" "$after"' EXIT
trap 'exit 129' HUP
trap 'exit 130' INT
trap 'exit 143' TERM
if [ ! -e "$policy" ]; then  # an existing one is the machine's: left as it is
    ours=1
    printf '#!/bin/sh\nexit 101\n' >"$policy"
    chmod 755 "$policy"
fi
apt_update && DEBIAN_FRONTEND=noninteractive "$apt" install -y -qq "-oDPkg::Lock::Timeout=$lock_wait" "$@" >/dev/null
rc=$?
restore
exit "$rc"
