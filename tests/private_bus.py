"""A real dbus-daemon of type system, private to one test, with our shipped policy included."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
POLICY = REPO / "etc" / "dbus-1" / "system.d" / "org.supervisordgpu.conf"

# The default policy of Debian's system bus (system.conf), trimmed to what matters here.
_CONFIG = """<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-BUS Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <type>system</type>
  <listen>unix:path={socket}</listen>
  <auth>EXTERNAL</auth>
  <policy context="default">
    <allow user="*"/>
    <deny own="*"/>
    <deny send_type="method_call"/>
    <allow send_type="signal"/>
    <allow send_requested_reply="true" send_type="method_return"/>
    <allow send_requested_reply="true" send_type="error"/>
    <allow receive_type="method_call"/>
    <allow receive_type="method_return"/>
    <allow receive_type="error"/>
    <allow receive_type="signal"/>
    <allow send_destination="org.freedesktop.DBus" send_interface="org.freedesktop.DBus"/>
    <allow send_destination="org.freedesktop.DBus" send_interface="org.freedesktop.DBus.Introspectable"/>
    <allow send_destination="org.freedesktop.DBus" send_interface="org.freedesktop.DBus.Properties"/>
  </policy>
  {extra}
  {include}
</busconfig>
"""

PERMISSIVE = """<policy context="default"><allow send_destination_prefix="org.supervisordgpu.instance"/></policy>"""


class PrivateBus:
    def __init__(self, permissive: bool = False, policy: Path | None = POLICY) -> None:
        """`policy` None: the bus without ours, as on a machine where only a checkout is."""
        self.dir = Path(tempfile.mkdtemp(prefix="gpusup-bus-"))
        os.chmod(self.dir, 0o755)  # an unprivileged test user must reach the socket
        self.socket = self.dir / "system_bus_socket"
        config = self.dir / "bus.conf"
        include = "" if policy is None else f"<include>{policy}</include>"
        config.write_text(_CONFIG.format(socket=self.socket, include=include, extra=PERMISSIVE if permissive else ""))
        self.proc = subprocess.Popen(
            ["dbus-daemon", f"--config-file={config}", "--nofork", "--nopidfile"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 5
        while not self.socket.exists():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError("dbus-daemon did not start")
            time.sleep(0.005)
        self.address = f"unix:path={self.socket}"

    def env(self) -> dict[str, str]:
        return {**os.environ, "DBUS_SYSTEM_BUS_ADDRESS": self.address}

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(5)
        shutil.rmtree(self.dir, ignore_errors=True)
