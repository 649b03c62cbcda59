"""The daemon's faces outward: its D-Bus API (service, exports; client for gpusupctl) and what it tells systemd (notify)."""
