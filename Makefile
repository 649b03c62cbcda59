# supervisord-gpu: the two set-up commands of the README, and what they need.
#   make rehearse   rehearse pd-1p1d with stand-in servers on simulated GPUs (no GPU needed)
#   make test       the whole test suite (what CI runs)
#   make rehearse-cluster   the same rehearsal across three hosts (containers) with etcd

PY      ?= /usr/bin/python3
VENV    ?= .venv
PROFILE ?= pd-1p1d
APT_PKGS = python3-venv python3-gi dbus libglib2.0-bin
TEST_APT_PKGS = systemd-container debootstrap dbus prometheus etcd-server openssl acl
# Debian starts and enables the daemons it installs (etcd on 2379, prometheus on 9090, its node
# exporter on 9100, and what their Recommends bring; debhelper brings man-db and its timer): the
# tests start their own, on addresses they own, so the host gets none. Every apt install here
# goes through tests/rig/install_quietly.sh.
STAMP   = $(VENV)/.installed

.PHONY: rehearse rehearse-cluster test check setup test-setup lint bench deb clean

$(STAMP): pyproject.toml
	@if [ "$$(id -u)" = 0 ] && ! dpkg -s $(APT_PKGS) >/dev/null 2>&1; then \
	    sh tests/rig/install_quietly.sh $(APT_PKGS); fi
	$(PY) -m venv --system-site-packages $(VENV)
	$(VENV)/bin/pip install -q --disable-pip-version-check -e '.[test,bench,metrics,cluster]'
	touch $@

setup: $(STAMP)

test-setup: $(STAMP)
	@if [ "$$(id -u)" = 0 ] && ! dpkg -s $(TEST_APT_PKGS) >/dev/null 2>&1; then \
	    sh tests/rig/install_quietly.sh $(TEST_APT_PKGS); fi

# The shipped profiles run their servers as the package's unprivileged user and the router as
# one of its own (what the .deb's postinst creates).
SERVER_USER = sglang
ROUTER_USER = sglang-router

rehearse: $(STAMP)
	@if [ "$$(id -u)" = 0 ]; then for u in $(SERVER_USER) $(ROUTER_USER); do getent passwd $$u >/dev/null || \
	    useradd --system --user-group --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin $$u; done; fi
	$(VENV)/bin/gpusupctl rehearse $(PROFILE) --config-dir etc/supervisord-gpu

# The cluster on one machine: three real systemd hosts in containers on a private bridge,
# etcd on one, PD across the other two, a switch to one TP server spanning both and back.
rehearse-cluster: test-setup
	$(VENV)/bin/python tests/cluster_rehearsal.py

# The suite in two tiers. `make check` first: lint, types and the fast tests (no server, no
# container; tests/conftest.py names them), well under a minute, so a broken import fails there. Then the
# rest, which mostly waits (for servers, for systemd), in TEST_WORKERS parallel workers;
# the tests that must share the host's network run one at a time (xdist group host-network).
# From a checkout nobody may enter (/root), the tests that run servers or attackers as nobody
# run in a mount namespace where it may (supervisord_gpu/rehearsal/reach.py); elsewhere a no-op.
TEST_WORKERS ?= 4
REACH = $(VENV)/bin/python -m supervisord_gpu.rehearsal.reach nobody,$(SERVER_USER),$(ROUTER_USER) $(CURDIR) --

test: test-setup check
	$(REACH) $(VENV)/bin/python -m pytest -q -rfEs -m "not fast" -n $(TEST_WORKERS) --dist loadgroup --durations=25

check: lint
	$(REACH) $(VENV)/bin/python -m pytest -q -rs -m fast --durations=5

# A linter and a type checker over the product code; any finding fails `make check`.
lint: $(STAMP)
	$(VENV)/bin/ruff check supervisord_gpu
	$(VENV)/bin/mypy

bench: test-setup
	$(VENV)/bin/python bench/run.py

clean:
	rm -rf $(VENV) build dist *.egg-info

# make deb   the Debian package, lintian-clean: build/supervisord-gpu_VERSION_all.deb.
# debian/ lives in packaging/debian/; the package is built from a copy of the source
# (git-tracked and untracked-but-not-ignored files) in build/deb/supervisord-gpu-UPSTREAM/.
# DEB_OUT=DIR puts the tree and the results elsewhere (the tests build in a temporary dir).
DEB_OUT     ?= build
DEB_VERSION  = $(shell sed -n '1s/^[^(]*(\([^)]*\)).*/\1/p' packaging/debian/changelog)
DEB_UPSTREAM = $(firstword $(subst -, ,$(DEB_VERSION)))
DEB_TREE     = $(DEB_OUT)/deb/supervisord-gpu-$(DEB_UPSTREAM)
DEB_FILE     = $(DEB_OUT)/supervisord-gpu_$(DEB_VERSION)_all.deb
DEB_APT_PKGS = debhelper dh-python pybuild-plugin-pyproject python3-all python3-setuptools lintian
# Debian's own tools only: pyenv shims or a virtualenv first on PATH make pybuild run the
# wrong python ("No module named build").
DEB_ENV      = env -u PYTHONPATH -u PYTHONHOME -u VIRTUAL_ENV PATH=/usr/sbin:/usr/bin:/sbin:/bin

deb:
	@if [ "$$(id -u)" = 0 ] && ! dpkg -s $(DEB_APT_PKGS) >/dev/null 2>&1; then \
	    echo "installing build tools: $(DEB_APT_PKGS)"; \
	    sh tests/rig/install_quietly.sh $(DEB_APT_PKGS); fi
	@rm -rf $(DEB_OUT)/deb $(DEB_OUT)/supervisord-gpu_$(DEB_VERSION)_* && mkdir -p $(DEB_TREE)
	@if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then \
	    git ls-files -z --cached --others --exclude-standard \
	      | xargs -0 sh -c 'for f; do [ -e "$$f" ] && printf "%s\0" "$$f"; done' sh \
	      | tar --null -T - -cf - | tar -xf - -C $(DEB_TREE); \
	else \
	    tar --exclude=./.git --exclude=./.venv --exclude=./build --exclude=./dist --exclude='*.egg-info' \
	        --exclude=__pycache__ --exclude=./.pytest_cache --exclude=./.mypy_cache -cf - . | tar -xf - -C $(DEB_TREE); \
	fi
	@rm -rf $(DEB_TREE)/debian && cp -a packaging/debian $(DEB_TREE)/debian
	@echo "dpkg-buildpackage -us -uc -b in $(DEB_TREE) (log: $(DEB_OUT)/deb/build.log)"
	@cd $(DEB_TREE) && $(DEB_ENV) dpkg-buildpackage -us -uc -b >../build.log 2>&1 \
	    || { tail -n 40 ../build.log; echo "make deb: dpkg-buildpackage failed; full log in $(DEB_OUT)/deb/build.log" >&2; exit 1; }
	@mv $(DEB_OUT)/deb/supervisord-gpu_$(DEB_VERSION)_* $(DEB_OUT)/
	@echo "lintian $(DEB_FILE)"
	@$(DEB_ENV) lintian --fail-on error,warning $(DEB_FILE)
	@echo "$(DEB_FILE)"
