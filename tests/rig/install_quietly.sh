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
trap 'rm -f "$before" "$after"' EXIT
find "$units" -type l 2>/dev/null | sort >"$before"

ours=
if [ ! -e "$policy" ]; then  # an existing one is the machine's: left as it is
    ours=1
    printf '#!/bin/sh\nexit 101\n' >"$policy"
    chmod 755 "$policy"
fi
"$apt" update -qq && DEBIAN_FRONTEND=noninteractive "$apt" install -y -qq "$@" >/dev/null
rc=$?
[ -z "$ours" ] || rm -f "$policy"

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
exit "$rc"
