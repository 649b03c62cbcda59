"""Command-line edges: `supervisord-gpu` (the daemon) and `gpusupctl` (the operator's tool)."""
