"""Glue to systemd: sd_notify, the journal, and (in ownership/) transient scopes."""
