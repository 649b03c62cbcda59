"""The supervision engine: start in dependency order, observe readiness, stop in order, restart.

It knows nothing of D-Bus, systemd or the CLI; those subscribe to its events.
"""
