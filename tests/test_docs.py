"""The documents a user reads, held to the code they describe.

The reference (docs/reference.md) is tested against the loader itself, not against a list
kept beside it: the loader reads every file through `config.tables.Table`, whose getters
take one key each, so recording those calls while the loader parses profiles and a daemon
config that use every branch gives exactly the keys it accepts, with their types and
defaults. A key the loader gains and the reference lacks, a key the reference keeps after
the loader dropped it, a default that moved: each fails here, in the fast tier.

docs/operations.md is held to the code it describes the same way: every journal field and event
the package writes, errors.py's exit codes and its table of errors (each class with its D-Bus
name and exit code, both ways), and engine/states.py's two tables of allowed moves, state by
state. docs/design.md's floors and forbidden imports are tests/test_layers.py's.

The rest keeps the README the short page it is meant to be (under 250 lines, exactly the
two set-up commands) and every relative link in the documents pointing at a file.
"""

from __future__ import annotations

import ast
import inspect
import re
import tomllib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from supervisord_gpu.config import loader, tables
from supervisord_gpu.config.loader import load_daemon_config, parse_profile
from supervisord_gpu.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
REFERENCE = DOCS / "reference.md"
OPERATIONS = DOCS / "operations.md"
CONFIG_PACKAGE = ROOT / "supervisord_gpu" / "config"
README_MAX_LINES = 250
SETUP_COMMANDS = ["sh make.sh rehearse", "sh make.sh test"]

#: Table's getters and the word the reference's type column starts with for each
#: (raw: the caller checks the type itself, so the reference says what that is)
GETTER_TYPES: dict[str, str | None] = {
    "str": "string", "bool": "boolean", "int": "integer", "number": "number", "port": "port",
    "list": "list", "table": "table", "raw": None,
}
REQUIRED = object()
UNKNOWN = object()  # raw(): the loader asks has() first, so whether it is required is decided elsewhere

# -------------------------------------------------------------------------- what the loader accepts

#: one single-machine PD profile with every key set (the router in "pd" mode)
PD_EVERY_KEY = """
description = "every key"
takeover = true
rollback = true
stop_order = ["router", "decode", "prefill"]
[restart]
mode = "on-failure"
max_restarts = 5
window = 600
backoff_initial = 1.0
backoff_max = 30.0
[defaults]
user = "root"
start_timeout = 900
stop_timeout = 60
start_timeout_max = 14400
[defaults.env]
A = "1"
[servers.prefill]
role = "prefill"
gpus = [0, 1]
host = "127.0.0.1"
port = 30100
model_path = "/models/m"
user = "root"
after = []
start_timeout = 900
start_timeout_max = 14400
stop_timeout = 60
[servers.prefill.probe]
path = "/health"
interval = 0.5
timeout = 25
liveness_path = "/ready"
liveness_interval = 10
liveness_timeout = 20
failures = 3
scheduler_timeout = 300
[servers.prefill.options]
tp-size = 2
disaggregation-bootstrap-port = 8998
[servers.prefill.env]
B = "2"
[servers.decode]
role = "decode"
gpus = [2, 3]
port = 30200
model_path = "/models/m"
[servers.decode.options]
tp-size = 2
[router]
mode = "pd"
host = "0.0.0.0"
port = 30001
prefill = ["prefill"]
decode = ["decode"]
user = "root"
after = ["prefill", "decode"]
start_timeout = 120
start_timeout_max = 14400
stop_timeout = 200
[router.probe]
path = "/readiness"
interval = 0.2
timeout = 5
liveness_path = "/liveness"
liveness_interval = 10
liveness_timeout = 10
failures = 3
[router.options]
prometheus-port = 30091
[router.env]
C = "3"
"""

#: the least a profile needs: one server behind a regular router, every default taken
MINIMAL_REGULAR = """
[servers.one]
gpus = [0]
port = 30000
model_path = "/models/m"
user = "root"
[router]
port = 30001
workers = ["one"]
user = "root"
[router.options]
prometheus-port = 30091
"""

#: a profile that spans nodes: a server over two nodes, one on a node of its own, the router on a third
SPANS_NODES = """
[nodes.a]
address = "10.0.0.1"
[nodes.b]
address = "10.0.0.2"
[servers.big]
nodes = ["a", "b"]
dist_init_port = 20000
host = "0.0.0.0"
gpus = [0, 1, 2, 3]
port = 30000
model_path = "/models/m"
user = "root"
[servers.big.options]
tp-size = 8
[servers.small]
node = "b"
host = "0.0.0.0"
gpus = [4]
port = 30010
model_path = "/models/m"
user = "root"
[router]
node = "a"
port = 30001
user = "root"
[router.options]
prometheus-port = 30091
"""

#: a daemon config with every key set
DAEMON_EVERY_KEY = """
[daemon]
ownership = "auto"
cgroup_root = "/sys/fs/cgroup/supervisord-gpu"
leftovers = "clean"
runtime_dir = "/run/supervisord-gpu"
cache_dir = "/var/cache/supervisord-gpu"
default_user = "root"
strict_modes = true
control_group = "gpusup"
start_stall_timeout = 120
[sglang]
server_command = ["python3", "-m", "sglang.launch_server"]
router_command = ["python3", "-m", "sglang_router.launch_router"]
[gpus]
backend = "auto"
idle_tolerance_mib = 256
wait_idle_timeout = 60
[gpus.baseline_mib]
"0" = 615
[rehearsal]
enabled = false
gpu_count = 8
gpu_memory_mib = 143771
server_startup = 3.0
server_mib_per_gpu = 100000
router = "auto"
simgpu_dir = "/run/supervisord-gpu/simgpu"
[metrics]
enabled = false
host = "127.0.0.1"
port = 9464
[cluster]
node = "a"
etcd = ["https://10.0.0.3:2379"]
prefix = "/supervisord-gpu"
lease_ttl = 10
cacert = "/etc/supervisord-gpu/etcd/ca.pem"
cert = "/etc/supervisord-gpu/etcd/node.pem"
key = "/etc/supervisord-gpu/etcd/node-key.pem"
user = "gpusup"
password_file = "/etc/supervisord-gpu/etcd/password"
"""


class Accepted:
    """Every key the loader took while it was watched: its kind (the getter) and the defaults it passed."""

    def __init__(self) -> None:
        self.kinds: dict[str, set[str]] = {}
        self.defaults: dict[str, list[Any]] = {}

    def add(self, key: str, kind: str, default: Any) -> None:
        key = generic(key)
        self.kinds.setdefault(key, set()).add(kind)
        self.defaults.setdefault(key, []).append(default)

    def keys(self) -> set[str]:
        return set(self.kinds)


def generic(key: str) -> str:
    """servers.prefill.port -> servers.NAME.port, nodes.a.address -> nodes.NAME.address."""
    parts = key.split(".")
    if len(parts) > 1 and parts[0] in ("servers", "nodes"):
        parts[1] = "NAME"
    return ".".join(parts)


@contextmanager
def watching_the_loader(monkeypatch: pytest.MonkeyPatch) -> Iterator[Accepted]:
    """Record each key a Table getter takes (the outermost getter: `port` calls `int`)."""
    seen = Accepted()
    depth = [0]

    def watched(kind: str, original: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(original)

        def getter(self: tables.Table, name: str, *args: Any, **kwargs: Any) -> Any:
            if depth[0] == 0:
                bound = signature.bind(self, name, *args, **kwargs)
                bound.apply_defaults()
                if kind == "table":
                    default = REQUIRED if bound.arguments["required"] else {}
                elif kind == "raw":
                    default = UNKNOWN
                else:
                    default = bound.arguments.get("default", REQUIRED)
                seen.add(self.key(name), kind, REQUIRED if default is tables._MISSING else default)
            depth[0] += 1
            try:
                return original(self, name, *args, **kwargs)
            finally:
                depth[0] -= 1

        return getter

    original_init = tables.Table.__init__

    def init(self: tables.Table, path: Any, prefix: str, data: Any) -> None:
        original_init(self, path, prefix, data)
        if prefix and depth[0] == 0:  # servers.NAME, nodes.NAME: tables the loader opens by name
            seen.add(prefix, "table", UNKNOWN)

    for kind in GETTER_TYPES:
        monkeypatch.setattr(tables.Table, kind, watched(kind, getattr(tables.Table, kind)))
    monkeypatch.setattr(tables.Table, "__init__", init)
    yield seen


@pytest.fixture(scope="module")
def accepted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Accepted]:
    """What the loader accepts, per document: {"profile": ..., "daemon config": ...}."""
    config_dir = tmp_path_factory.mktemp("config")
    (config_dir / loader.DAEMON_FILE).write_text(DAEMON_EVERY_KEY)
    empty_dir = tmp_path_factory.mktemp("empty-config")
    (empty_dir / loader.DAEMON_FILE).write_text("")
    try:
        with pytest.MonkeyPatch.context() as mp, watching_the_loader(mp) as profile:
            for i, text in enumerate((PD_EVERY_KEY, MINIMAL_REGULAR, SPANS_NODES)):
                parse_profile(f"p{i}", Path(f"/nowhere/p{i}.toml"), tomllib.loads(text))
        with pytest.MonkeyPatch.context() as mp, watching_the_loader(mp) as daemon:
            load_daemon_config(config_dir)
            load_daemon_config(empty_dir)
    except ConfigError as e:
        pytest.fail(f"the loader refuses a fixture of tests/test_docs.py ({e}): a key it no longer "
                    "accepts goes from the fixture and from docs/reference.md", pytrace=False)
    return {"profile": profile, "daemon config": daemon}


def literal_getter_names() -> set[str]:
    """Every key name written as a literal in a getter call in config/ (a branch the fixtures
    above must reach: a key added where they do not go would otherwise escape the check)."""
    names = set()
    for path in CONFIG_PACKAGE.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in GETTER_TYPES
                    and isinstance(node.func.value, ast.Name) and node.args
                    and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
                names.add(node.args[0].value)
    return names


def test_the_fixtures_reach_every_key_the_loader_names(accepted: dict[str, Accepted]) -> None:
    taken = {key.rsplit(".", 1)[-1] for doc in accepted.values() for key in doc.keys()}
    missed = literal_getter_names() - taken
    assert not missed, f"keys in config/ no fixture of tests/test_docs.py reaches (add them there): {sorted(missed)}"


# -------------------------------------------------------------------------- what the reference says

class Row:
    def __init__(self, key: str, kind: str, default: str, meaning: str) -> None:
        self.key, self.kind, self.default, self.meaning = key, kind, default, meaning


def reference_rows(text: str) -> dict[str, dict[str, Row]]:
    """`| \\`key\\` | type | default | meaning |` rows under `## Profile...` and `## Daemon config...`."""
    out: dict[str, dict[str, Row]] = {"profile": {}, "daemon config": {}}
    section: str | None = None
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("## "):
            title = line[3:].lower()
            section = "profile" if title.startswith("profile") else "daemon config" if title.startswith("daemon config") else None
            continue
        m = re.match(r"^\|\s*`([^`]+)`\s*\|", line)
        if not m or section is None:
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        assert len(cells) == 4 and all(cells), f"reference.md:{number}: a key's row is key | type | default | meaning: {line}"
        key = m[1]
        assert key not in out[section], f"reference.md:{number}: {key} is documented twice"
        out[section][key] = Row(key, *cells[1:])
    return out


@pytest.fixture(scope="module")
def reference() -> dict[str, dict[str, Row]]:
    return reference_rows(REFERENCE.read_text())


@pytest.mark.parametrize("document", ["profile", "daemon config"])
def test_every_key_the_loader_accepts_is_in_the_reference(accepted, reference, document) -> None:
    missing = accepted[document].keys() - reference[document].keys()
    assert not missing, f"docs/reference.md lacks these {document} keys the loader accepts: {sorted(missing)}"


@pytest.mark.parametrize("document", ["profile", "daemon config"])
def test_every_key_in_the_reference_is_accepted_by_the_loader(accepted, reference, document) -> None:
    unknown = reference[document].keys() - accepted[document].keys()
    assert not unknown, f"docs/reference.md documents {document} keys the loader refuses: {sorted(unknown)}"


@pytest.mark.parametrize("document", ["profile", "daemon config"])
def test_the_reference_gives_each_key_the_loaders_type(accepted, reference, document) -> None:
    wrong = []
    for key, kinds in accepted[document].kinds.items():
        row = reference[document].get(key)
        words = {GETTER_TYPES[k] for k in kinds} - {None}
        if row is not None and words and not any(row.kind.lower().startswith(w) for w in words):
            wrong.append(f"{key}: {row.kind!r}, the loader reads a {' or '.join(sorted(words))}")
    assert not wrong, "docs/reference.md types: " + "; ".join(wrong)


def toml_literal(cell: str) -> tuple[bool, Any]:
    """The value of a default cell that starts with a backquoted TOML value (`"auto"`, `120`, `[...]`)."""
    m = re.match(r"^`([^`]+)`", cell)
    if not m:
        return False, None
    try:
        value = tomllib.loads(f"v = {m[1]}")["v"]
    except tomllib.TOMLDecodeError:
        return False, None
    return True, tuple(value) if isinstance(value, list) else value


@pytest.mark.parametrize("document", ["profile", "daemon config"])
def test_the_reference_states_the_loaders_defaults(accepted, reference, document) -> None:
    """Required where the loader requires; a written default equal to the loader's; a scalar
    default the loader always passes the same way written as that value."""
    wrong = []
    for key, defaults in accepted[document].defaults.items():
        row = reference[document].get(key)
        if row is None or any(d is UNKNOWN for d in defaults):
            continue
        required = any(d is REQUIRED for d in defaults)
        if required != row.default.lower().startswith("required"):
            wrong.append(f"{key}: the loader {'requires it' if required else 'does not require it'}, the reference says {row.default!r}")
            continue
        is_literal, value = toml_literal(row.default)
        if is_literal and value not in defaults:
            wrong.append(f"{key}: the reference says {row.default!r}, the loader's default is {defaults[0]!r}")
        scalar = {d for d in defaults if isinstance(d, (str, int, float, bool))}
        if not is_literal and len(scalar) == 1 and len(set(map(repr, defaults))) == 1:
            wrong.append(f"{key}: write the default as the value `{defaults[0]!r}` (the loader's), not {row.default!r}")
    assert not wrong, "docs/reference.md defaults: " + "; ".join(wrong)


def test_the_reference_names_every_flag_a_profile_key_owns(reference) -> None:
    text = REFERENCE.read_text()
    missing = [f"--{flag}" for flag in {**loader.SERVER_MANAGED, **loader.ROUTER_MANAGED} if f"`--{flag}`" not in text]
    assert not missing, f"docs/reference.md does not name these flags that options may not set: {missing}"


# -------------------------------------------------------------------------- operations: the journal

def journal_names_in_code() -> set[str]:
    """GPUSUP_* fields and the GPUSUP_EVENT values the package writes as literals."""
    names: set[str] = set()
    for path in (ROOT / "supervisord_gpu").rglob("*.py"):
        text = path.read_text()
        names |= set(re.findall(r"\b(GPUSUP_[A-Z_]+)\b", text))
        names |= set(re.findall(r'GPUSUP_EVENT="([a-z-]+)"', text))
    return names


def test_operations_names_every_journal_field_and_event_the_daemon_writes() -> None:
    text = OPERATIONS.read_text()
    missing = sorted(n for n in journal_names_in_code() if f"`{n}`" not in text)
    assert not missing, f"docs/operations.md (The journal) lacks: {missing}"


# -------------------------------------------------------------------------- operations: exit codes and states

def section(text: str, title: str) -> str:
    """The lines of `## title` up to the next `## ` heading (its `###` subsections included)."""
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, flags=re.S | re.M)
    assert m, f"docs/operations.md has no section '## {title}'"
    return m[1]


def subsection(text: str, title: str) -> str:
    """The lines of `### title` up to the next heading."""
    m = re.search(rf"^### {re.escape(title)}\n(.*?)(?=^#+ |\Z)", text, flags=re.S | re.M)
    assert m, f"docs/operations.md has no subsection '### {title}'"
    return m[1]


def documented_errors(text: str) -> dict[str, tuple[str, int]]:
    """`| `Class` | `D-Bus name` | exit | when |` rows: class -> (D-Bus name, exit code)."""
    rows: dict[str, tuple[str, int]] = {}
    for name, dbus_name, code in re.findall(r"^\| `(\w+)` \| `([\w.]+)` \| (\d+) \|", text, flags=re.M):
        assert name not in rows, f"docs/operations.md documents {name} twice"
        rows[name] = (dbus_name, int(code))
    return rows


def test_operations_exit_codes_hold_every_error_of_the_table_with_its_d_bus_name_and_exit_code() -> None:
    """errors.py's ERRORS, each with its D-Bus name and exit code, is the doc's error table, both ways."""
    from supervisord_gpu.errors import ERRORS

    documented = documented_errors(section(OPERATIONS.read_text(), "Exit codes"))
    code = {cls.__name__: (cls.dbus_name, cls.exit_code) for cls in ERRORS}
    missing = sorted(set(code) - set(documented))
    assert not missing, f"docs/operations.md (Exit codes) lacks these errors of errors.py's ERRORS: {missing}"
    gone = sorted(set(documented) - set(code))
    assert not gone, f"docs/operations.md (Exit codes) documents errors errors.py's ERRORS does not have: {gone}"
    wrong = [f"{name}: the doc says {documented[name]}, errors.py {code[name]}" for name in sorted(code)
             if documented[name] != code[name]]
    assert not wrong, "docs/operations.md (Exit codes): " + "; ".join(wrong)


def test_operations_exit_codes_list_every_exit_code_gpusupctl_has() -> None:
    """The first table of the section is gpusupctl's codes: exactly errors.py's EXIT_* values."""
    from supervisord_gpu import errors

    codes = {v for k, v in vars(errors).items() if k.startswith("EXIT_") and isinstance(v, int)}
    text = section(OPERATIONS.read_text(), "Exit codes")
    first_table = re.search(r"^\| code \| meaning \|\n\|---\|---\|\n((?:\|.*\n)+)", text, flags=re.M)
    assert first_table, "docs/operations.md (Exit codes) starts with a `| code | meaning |` table"
    documented = [int(c) for c in re.findall(r"^\| (\d+) \|", first_table[1], flags=re.M)]
    assert sorted(documented) == sorted(codes), f"docs/operations.md's exit codes {documented}, errors.py's {sorted(codes)}"


def documented_moves(text: str) -> dict[str, set[str]]:
    """`| `from` | `to`, `to` | why |` rows: from -> the states it may move to."""
    moves: dict[str, set[str]] = {}
    for origin, targets in re.findall(r"^\| `(\w+)` \| ((?:`\w+`(?:, )?)+) \|", text, flags=re.M):
        assert origin not in moves, f"docs/operations.md lists the moves from {origin} twice"
        moves[origin] = set(re.findall(r"`(\w+)`", targets))
    return moves


@pytest.mark.parametrize("title, table", [("Instance moves", "INSTANCE_MOVES"), ("Process moves", "PROCESS_MOVES")])
def test_operations_states_hold_the_engines_tables_of_moves(title: str, table: str) -> None:
    """engine/states.py's tables of allowed moves are the doc's, state by state, both ways."""
    from supervisord_gpu.engine import states

    code = {old.value: {new.value for new in targets} for old, targets in getattr(states, table).items()}
    documented = documented_moves(subsection(section(OPERATIONS.read_text(), "States"), title))
    assert documented == code, (f"docs/operations.md (States, {title}) differs from engine/states.py's {table}: "
                                f"the doc {documented}, the code {code}")


# -------------------------------------------------------------------------- the README and the links

def documents() -> list[Path]:
    return [README, ROOT / "SECURITY.md", ROOT / "bench" / "README.md", *sorted(DOCS.glob("*.md"))]


def relative_links(text: str) -> list[tuple[str, str]]:
    """(file, anchor) of each [text](target) link that points into the tree (not a URL)."""
    targets = re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", text)
    return [tuple(t.split("#", 1)) if "#" in t else (t, "") for t in targets if not re.match(r"^[a-z]+:", t)]


def anchors(markdown: str) -> set[str]:
    """GitHub's anchors for a document's headings: lower case, punctuation dropped, spaces to '-'."""
    headings = re.findall(r"^#+ (.*)$", re.sub(r"^```.*?^```", "", markdown, flags=re.S | re.M), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_every_relative_link_in_the_documents_points_to_a_file_that_exists() -> None:
    broken = []
    for doc in documents():
        for target, anchor in relative_links(doc.read_text()):
            path = doc.parent / target if target else doc
            if not path.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path.read_text()):
                broken.append(f"{doc.relative_to(ROOT)}: {target}#{anchor} (no such heading)")
    assert not broken, f"links to nothing: {broken}"


def test_the_documents_exist() -> None:
    for name in ("operations.md", "reference.md", "security.md", "design.md", "real-sglang.md"):
        assert (DOCS / name).is_file(), f"docs/{name}"
    assert (ROOT / "bench" / "README.md").is_file()


def test_the_readme_is_under_250_lines() -> None:
    lines = len(README.read_text().splitlines())
    assert lines < README_MAX_LINES, f"README.md is {lines} lines; move the detail to docs/"


def test_the_readme_holds_exactly_the_two_setup_commands() -> None:
    """The set-up block is the two commands and nothing else, no other make.sh verb is shown
    anywhere, and each is a target of the Makefile that make.sh hands over to."""
    text = README.read_text()
    blocks = re.findall(r"^```sh\n(.*?)^```", text, flags=re.S | re.M)
    setup = [b for b in blocks if "make.sh" in b]
    assert len(setup) == 1, f"README.md: one ```sh block with the set-up commands, found {len(setup)}"
    commands = [line.split("#", 1)[0].strip() for line in setup[0].splitlines() if line.split("#", 1)[0].strip()]
    assert commands == SETUP_COMMANDS
    verbs = set(re.findall(r"\bsh make\.sh ([\w-]+)", text))
    assert verbs == {"rehearse", "test"}, f"README.md shows make.sh with {sorted(verbs)}"
    makefile = (ROOT / "Makefile").read_text()
    for verb in verbs:
        assert re.search(rf"^{verb}:", makefile, flags=re.M), f"the Makefile has no target {verb}"
    assert (ROOT / "make.sh").is_file()


def test_the_design_lists_the_floors_the_layer_test_holds() -> None:
    from test_layers import FLOORS

    text = (DOCS / "design.md").read_text()
    rows = re.findall(r"^\| (\d+) \| ((?:`[a-z_]+`(?:, )?)+) \|$", text, flags=re.M)
    documented = {name: int(floor) for floor, names in rows for name in re.findall(r"`([a-z_]+)`", names)}
    assert documented == FLOORS, "docs/design.md's floor table differs from tests/test_layers.py's FLOORS"


def test_the_design_names_every_import_the_layer_test_forbids() -> None:
    from test_layers import FORBIDDEN

    text = " ".join((DOCS / "design.md").read_text().split())
    missing = [f"`{mine}` never imports `{theirs}`" for mine, never in FORBIDDEN.items() for theirs in sorted(never)
               if f"`{mine}` never imports `{theirs}`" not in text]
    assert not missing, f"docs/design.md does not say what tests/test_layers.py's FORBIDDEN holds: {missing}"
