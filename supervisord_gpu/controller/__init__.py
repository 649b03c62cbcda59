"""The controller: one lifecycle behind every verb (see controller.py)."""
