"""D-Bus plumbing: the system bus link (one per process, reconnecting), D-Bus errors by name, our bus names."""
