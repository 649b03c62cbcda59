"""Configuration: the daemon-wide file and one profile per deployment, strictly validated.

Importing this package costs only the standard library, so `gpusupctl render` and
`gpusupctl check` stay fast.
"""

from .model import DaemonConfig, ProcessSpec, Profile  # noqa: F401
