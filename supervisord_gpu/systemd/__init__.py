"""systemd's side: its manager over D-Bus (units, jobs), the journal, the restart counter (sd_notify is api/notify.py)."""
