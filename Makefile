# supervisord-gpu: the two set-up commands of the README, and what they need.
#   make rehearse   rehearse pd-1p1d with stand-in servers on simulated GPUs (no GPU needed)
#   make test       the whole test suite (what CI runs)

PY      ?= /usr/bin/python3
VENV    ?= .venv
PROFILE ?= pd-1p1d
APT_PKGS = python3-venv python3-gi dbus libglib2.0-bin
TEST_APT_PKGS = systemd-container debootstrap dbus
STAMP   = $(VENV)/.installed

.PHONY: rehearse test setup test-setup bench deb clean

$(STAMP): pyproject.toml
	@if [ "$$(id -u)" = 0 ] && ! dpkg -s $(APT_PKGS) >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(APT_PKGS) >/dev/null; fi
	$(PY) -m venv --system-site-packages $(VENV)
	$(VENV)/bin/pip install -q --disable-pip-version-check -e '.[test,bench,metrics]'
	touch $@

setup: $(STAMP)

test-setup: $(STAMP)
	@if [ "$$(id -u)" = 0 ] && ! dpkg -s $(TEST_APT_PKGS) >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(TEST_APT_PKGS) >/dev/null; fi

rehearse: $(STAMP)
	$(VENV)/bin/gpusupctl rehearse $(PROFILE) --config-dir etc/supervisord-gpu

test: test-setup
	$(VENV)/bin/python -m pytest -q -rs

bench: $(STAMP)
	$(VENV)/bin/python bench/run.py

clean:
	rm -rf $(VENV) build dist *.egg-info
