"""A real prefill-decode pair on one GPU behind a real router, switched to one server and back,
driven through the daemon (issue 36, item 3). The machinery is real_sglang.py's: its Run,
Daemon and Check, its control socket standing in for D-Bus, its NVML reader.

Profiles (written by the run):
  pd1     prefill (port 30100, bootstrap 8998) + decode (30200), both on GPU 0 with
          `share_gpus = true` and mem-fraction-static 0.2, mooncake over TCP
          (MOONCAKE_PROTOCOL=tcp); the router in PD mode on 30001; stop order router, decode,
          prefill.
  tp1     one server on GPU 0 on port 30001 (the router's: clients never change).
  tp1bad  tp1 whose server fails after its spawn (real: a model whose architecture SGLang does
          not know; stand-in: SUPERVISORD_GPU_STANDIN_FAULT=crash-on-start).

On the device machine (no systemd, no D-Bus, no network), bundles under .sgl/ and .sglr/
(ignored by git; see bench/README.md):
  call 1, carry [".sgl"]:   python3 bench/device/real_pd.py unpack
  call 2, carry [".sglr"]:  python3 bench/device/real_pd.py unpack && \\
                            python3 bench/device/real_pd.py run --mode real --router sglang-router --out $OUT
  call 3 (warm):            python3 bench/device/real_pd.py run --mode real --router smg --out $OUT
`unpack` extracts each bundle present (.sgl/sglang-site.tar.xz, .sgl/mooncake-site.tar.xz,
.sglr/router-site.tar.xz, .sglr/smg-site.tar.xz) into /tmp/sgl/<name>/ unless already there, and
writes the tiny model (.sgl/make_tiny_model.py) to /tmp/sgl/model and its broken copy to
/tmp/sgl/model-bad. A torch_memory_saver wheel in any of them (.sglp/: sglang-site, the model maker
and that wheel, the park group's one-call layout) is extracted into sglang-site. `run` uses /tmp/sgl/* only: a warm machine's /tmp survives between calls.

Here, CPU only: stand-in servers on simulated GPUs, in front of them the stand-in router or a
real one installed in this venv (sglang-router 0.3.2, smg 1.13.0):
  .venv/bin/python bench/device/real_pd.py run --mode standin --router standin --out /tmp/rpd
  .venv/bin/python bench/device/real_pd.py run --mode standin --router sglang-router --out /tmp/rpd
  .venv/bin/python bench/device/real_pd.py run --mode standin --router smg --out /tmp/rpd
(The daemon runs without rehearsal mode here, so that the profile's router_command is the one
that runs: the stand-in server is its server_command, the simulated GPUs its GPU backend.)

Scenarios, each a list of assertions, PASS/FAIL printed and written to
$OUT/real-pd-<mode>-<router>.json (logs in $OUT/logs-pd-<mode>-<router>.tar.gz):
  p1_start     pd1 to READY; READY means the router lists both workers and a first /generate
               through it is 200 (the real router answered /health 200 before it had a prefill)
  p2_generate  /generate through the router: 200, tokens back; a direct /generate to the decode
               is refused (no bootstrap room)
  p3_switch    pd1 -> tp1 by the new daemon's takeover, N long requests in flight through the
               router: completed vs cut; stops router, decode, prefill in order; GPU verified idle
               (NVML) before tp1's spawn; the parts timed from the daemons' events
  p4_back      tp1 -> pd1, serving again through the same port
  p5_rollback  tp1bad takes pd1 over and fails after its spawn: exit 5 naming the rollback; pd1
               comes back (started again as systemd's rollback would: there is no systemd here)
               and serves
  p6_stop      stop of pd1 with N long requests in flight: router, then decode, then prefill;
               the GPU at its baseline after; no process of the run left, cgroups empty
Each scenario checks the time left first (--budget); what does not fit is "NOT RUN (budget)".
REAL_PD_PORTS=ROUTER,PREFILL,DECODE,BOOTSTRAP,METRICS moves the ports (default
30001,30100,30200,8998,30091).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import traceback
import zipfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

import real_sglang as R  # noqa: E402  (the machinery: Run, Daemon, Check, the control socket)

ROUTER_PORT, PREFILL_PORT, DECODE_PORT, BOOTSTRAP_PORT, METRICS_PORT = (
    int(x) for x in os.environ.get("REAL_PD_PORTS", "30001,30100,30200,8998,30091").split(","))
TP1_PORT = ROUTER_PORT
BUNDLE_DIRS = (".sgl", ".sglr", ".sglp")
#: wheels extracted into sglang-site where carried (SGLang imports them from there): the memory saver
#: that `--enable-memory-saver` needs (issue 39's p5/p7), absent from the trimmed bundle
SITE_WHEELS = ("torch_memory_saver-",)
BUNDLES = ("sglang-site", "mooncake-site", "router-site", "smg-site")
ROUTER_MODULES = {"sglang-router": "sglang_router.launch_router", "smg": "smg.launch_router",
                  "standin": "supervisord_gpu.rehearsal.standin_router"}
ROUTER_SITES = {"sglang-router": "router-site", "smg": "smg-site"}
PD_STOP_ORDER = ["router", "decode", "prefill"]
BAD_ENV = {"SUPERVISORD_GPU_STANDIN_FAULT": "crash-at-init"}  # as the real tp1bad: a scheduler exception at init, before any loading line
LONG_TOKENS = 1500  # real tiny model: ~3 ms a token; stand-in: SUPERVISORD_GPU_STANDIN_TOKEN_S x this


# ============================================================================ unpack

def cmd_unpack(args: argparse.Namespace) -> int:
    """Each bundle present, into DEST/<name>/ once (a `.done` marker); the tiny model and its broken copy."""
    dest = Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {}
    for d in BUNDLE_DIRS:
        for name in BUNDLES:
            tar = REPO / d / f"{name}.tar.xz"
            target = dest / name
            if (target / ".done").exists():
                report[name] = "already there"
                continue
            if not tar.exists():
                continue
            target.mkdir(parents=True, exist_ok=True)
            began = time.time()
            subprocess.run(["tar", "-xJf", str(tar), "-C", str(target)], check=True)
            (target / ".done").write_text(str(tar))
            report[name] = f"unpacked in {time.time() - began:.1f} s"
    for d in BUNDLE_DIRS:
        for whl in sorted((REPO / d).glob("*.whl")) if (REPO / d).is_dir() else []:
            site, mark = dest / "sglang-site", dest / "sglang-site" / f".{whl.name}.done"
            if not whl.name.startswith(SITE_WHEELS) or not (site / ".done").exists() or mark.exists():
                continue
            with zipfile.ZipFile(whl) as zf:
                zf.extractall(site)
            mark.write_text(str(whl))
            report[whl.name] = "extracted into sglang-site"
    maker = next((REPO / d / "make_tiny_model.py" for d in BUNDLE_DIRS if (REPO / d / "make_tiny_model.py").exists()),
                 REPO / ".sgl" / "make_tiny_model.py")
    model = dest / "model"
    if not (model / "config.json").exists() and maker.exists():
        subprocess.run([args.python or sys.executable, str(maker), str(model)], check=True, stdout=subprocess.DEVNULL)
        report["model"] = "written"
    if (model / "config.json").exists() and not (dest / "model-bad" / "config.json").exists():
        bad = dest / "model-bad"
        shutil.copytree(model, bad, dirs_exist_ok=True)
        cfg = json.loads((bad / "config.json").read_text())
        cfg["architectures"] = ["NoSuchModelForCausalLM"]  # SGLang fails in the scheduler, after the spawn
        (bad / "config.json").write_text(json.dumps(cfg))
        report["model-bad"] = "written"
    missing = [n for n in ("sglang-site", "mooncake-site") if not (dest / n / ".done").exists()]
    print(json.dumps({"dest": str(dest), "done": report, "present": sorted(p.name for p in dest.iterdir()),
                      "missing_for_real_servers": missing}, indent=1))
    return 0


# ============================================================================ the run

class PdRun(R.Run):
    """real_sglang.py's Run with the PD profiles, the router of --router and its own file names."""

    def __init__(self, args: argparse.Namespace) -> None:
        args.group = f"pd-{args.router}"
        args.work = args.work or f"/tmp/rpd-{args.mode}-{args.router}"
        super().__init__(args)
        self.rehearsal = False  # the profile's router_command must be the one that runs
        self.router = args.router
        self.results["router"] = args.router
        self.layout = "shared"

    def tag(self) -> str:
        return f"pd-{self.mode}-{self.router}"

    def save(self) -> None:
        self.results["elapsed_s"] = round(self.elapsed(), 1)
        (self.out / f"real-pd-{self.mode}-{self.router}.json").write_text(json.dumps(self.results, indent=1, default=str))

    def setup(self) -> None:
        s = self.results["setup"]
        began = time.time()
        s["code"] = {"from": str(REPO), "commit": R._git(["rev-parse", "HEAD"]),
                     "dirty": R._git(["status", "--short", "supervisord_gpu"])}
        sys.path.insert(0, str(self.code))
        unpacked = self.sgl_dir()
        if self.mode == "real":
            need = ["sglang-site", "mooncake-site", ROUTER_SITES[self.router]]
            missing = [n for n in need if not (unpacked / n / ".done").exists()]
            if missing or not (unpacked / "model" / "config.json").exists():
                raise RuntimeError(f"not unpacked under {unpacked}: {missing or ['model']} (run `real_pd.py unpack` with the bundles)")
            self.model, self.bad_model = unpacked / "model", unpacked / "model-bad"
            s["versions"] = self.pd_versions()
        else:
            self.model = self.work / "model"
            self.model.mkdir()
            (self.model / "config.json").write_text(json.dumps({"architectures": ["OlmoForCausalLM"], "model_type": "olmo"}))
            self.bad_model = self.model
            s["versions"] = {"standin": "supervisord_gpu/rehearsal/standin_server.py", "router": self.router_version()}
        self.write_config()
        s["layout"] = self.layout
        s["setup_s"] = round(time.time() - began, 1)
        self.gpu = self.make_gpu()
        if self.mode == "standin":
            from supervisord_gpu.checks.gpus import inventory_for
            from supervisord_gpu.config.loader import load_daemon_config

            inventory_for(load_daemon_config(self.etc), simulated=True)  # the simulated GPUs exist before anything reads them
        s["gpu"] = self.gpu.info()
        used, pids = self.gpu.read()
        self.baseline = used
        s["baseline_used_mib"], s["baseline_holders"] = used, pids
        self.shm_before = R.shm_names()
        self.gpu.start()

    def make_gpu(self) -> R.Gpu:
        """The independent GPU reader (real_multi.py reads every GPU of its group)."""
        return R.Gpu(self.mode, self.work / "simgpu")

    def router_version(self) -> str | None:
        if self.router == "standin":
            return "supervisord_gpu/rehearsal/standin_router.py"
        from importlib import metadata

        try:
            return metadata.version("sglang-router" if self.router == "sglang-router" else "smg")
        except metadata.PackageNotFoundError:
            return None

    def pd_versions(self) -> dict[str, Any]:
        from importlib import metadata

        v: dict[str, Any] = {"python": sys.version.split()[0]}
        wanted = {"sglang", "sglang-kernel", "mooncake-transfer-engine", "mooncake-transfer-engine-cuda13", "sglang-router", "smg"}
        for site in ("sglang-site", "mooncake-site", ROUTER_SITES[self.router]):
            for d in metadata.distributions(path=[str(self.sgl_dir() / site)]):
                if d.metadata["Name"] in wanted:
                    v[d.metadata["Name"]] = d.version
        for name in ("torch", "nvidia-ml-py"):
            try:
                v[name] = metadata.version(name)
            except metadata.PackageNotFoundError:
                v[name] = None
        return v

    # ---------------------------------------------------------------- config and profiles

    def write_config(self) -> None:
        etc = self.etc
        (etc / "profiles").mkdir(parents=True)
        for d in (etc, etc / "profiles"):
            os.chmod(d, 0o755)
        from supervisord_gpu.ownership.cgroupfs import cgroup2_mount

        mount = cgroup2_mount()
        self.cgroup_top = mount / f"rpd-{self.mode}-{os.getpid()}" if mount else None
        root = self.cgroup_top / "supervisord-gpu" if self.cgroup_top else None
        py = json.dumps(self.py)
        server_cmd = f'[{py}, "-m", "sglang.launch_server"]' if self.mode == "real" else \
            f'[{py}, "-m", "supervisord_gpu.rehearsal.standin_server"]'
        router_cmd = f'[{py}, "-m", "{ROUTER_MODULES[self.router]}"]'
        self.daemon_text = f"""
[daemon]
ownership = "cgroupfs"
{f'cgroup_root = "{root}"' if root else ''}
runtime_dir = "{self.work / 'run'}"
cache_dir = "{self.sgl_dir() / 'cache' if self.mode == 'real' else self.work / 'cache'}"
default_user = "root"
[sglang]
server_command = {server_cmd}
router_command = {router_cmd}
[gpus]
backend = "{'nvml' if self.mode == 'real' else 'simulated'}"
idle_tolerance_mib = {R.IDLE_TOLERANCE_MIB}
wait_idle_timeout = 60
"""
        self.write_profiles()

    def write_profiles(self) -> None:
        """pd1, tp1, tp1bad (real_multi.py writes its own), each loaded by this code before the run."""
        profiles = self.profiles(gpus_decode=0)
        self.write_all(profiles, gpu_count=1)
        why = self.refused("pd1")
        if why and self.mode == "standin" and ("share_gpus" in why or "also used by" in why):
            # this code has no shared GPUs yet: the stand-ins run the pair on two simulated GPUs
            self.layout = f"two GPUs (prefill 0, decode 1): this code refused the shared one: {why}"
            profiles = self.profiles(gpus_decode=1)
            self.write_all(profiles, gpu_count=2)
            why = self.refused("pd1")
        self.check_profiles(profiles, why, "pd1")

    def check_profiles(self, profiles: dict[str, str], why: str, first: str) -> None:
        """Every profile loads (`why`: the first one's refusal, already read), else RuntimeError."""
        for name in profiles:
            if name != first and (w := self.refused(name)):
                why = (why + "; " if why else "") + w
        if why:
            raise RuntimeError(f"the profiles do not load: {why}")
        self.results["setup"]["config"] = self.daemon_text
        self.results["setup"]["profiles"] = profiles

    def write_all(self, profiles: dict[str, str], gpu_count: int) -> None:
        text = self.daemon_text
        if self.mode == "standin":
            text += f"""
[rehearsal]
gpu_count = {gpu_count}
gpu_memory_mib = 81559
simgpu_dir = "{self.work / 'simgpu'}"
"""
        (self.etc / "supervisord-gpu.toml").write_text(text)
        for name, body in profiles.items():
            (self.etc / "profiles" / f"{name}.toml").write_text(body)

    def refused(self, name: str) -> str:
        """'' when the profile loads with this code, else its one-line refusal."""
        from supervisord_gpu.config.loader import load_daemon_config, load_profile

        try:
            load_profile(load_daemon_config(self.etc), name)
            return ""
        except Exception as e:  # ConfigError: one line naming file and key
            return str(e).splitlines()[0]

    def envs(self) -> tuple[dict[str, str], dict[str, str]]:
        """(server env, router env): what each process gets besides what the daemon sets."""
        common = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
        if self.mode == "real":
            site, moon = self.sgl_dir() / "sglang-site", self.sgl_dir() / "mooncake-site"
            server = {"PYTHONPATH": f"{site}:{moon}", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                      "SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK": "1", "CUDA_HOME": "/usr/local/cuda", "MOONCAKE_PROTOCOL": "tcp"}
            # the router imports setproctitle, which only the SGLang bundle has (real_sglang.py)
            router = {"PYTHONPATH": f"{self.sgl_dir() / ROUTER_SITES[self.router]}:{site}"}
        else:
            from supervisord_gpu.checks.simgpu import ENV_DIR

            server = {"PYTHONPATH": str(self.code), "SUPERVISORD_GPU_STANDIN_TOKEN_S": "0.003",
                      ENV_DIR: str(self.work / "simgpu"), "SUPERVISORD_GPU_STANDIN_STARTUP_S": str(self.args.standin_startup),
                      "SUPERVISORD_GPU_STANDIN_MIB": "16000", "MOONCAKE_PROTOCOL": "tcp"}
            router = {"PYTHONPATH": str(self.code)} if self.router == "standin" else {}
        return {**server, **common, "SGLANG_HEALTH_CHECK_TIMEOUT": str(R.HEALTH_CHECK_TIMEOUT)}, {**router, **common}

    def server_toml(self, name: str, port: int, mem: float, gpus: list[int], role: str = "", shared: bool = False,
                    model: Path | None = None, extra_options: str = "", extra_env: dict[str, str] | None = None) -> str:
        """One [servers.NAME] table: the tiny model (dummy weights, triton), on `gpus`."""
        server_env, _ = self.envs()
        return f"""
[servers.{name}]
{f'role = "{role}"' if role else ''}
gpus = [{", ".join(map(str, gpus))}]
{'share_gpus = true' if shared else ''}
host = "127.0.0.1"
port = {port}
model_path = "{model or self.model}"
start_timeout = 600
stop_timeout = 30
[servers.{name}.options]
load-format = "dummy"
attention-backend = "triton"
sampling-backend = "pytorch"
grammar-backend = "none"
mem-fraction-static = {mem}
disable-radix-cache = true
{extra_options}""" + env_table(f"servers.{name}", {**server_env, **(extra_env or {})})

    def pd_toml(self, description: str, prefill_gpus: list[int], decode_gpus: list[int], shared: bool, mem: float,
                extra_options: str = "") -> str:
        """A PD profile: prefill + decode (mooncake), the router in PD mode on ROUTER_PORT; stop order router, decode, prefill."""
        _, router_env = self.envs()
        return (f'description = "{description}"\n'
                'takeover = true\nrollback = true\nstop_order = ["router", "decode", "prefill"]\n'
                + self.server_toml("prefill", PREFILL_PORT, mem, prefill_gpus, "prefill", shared,
                                   extra_options=f'disaggregation-bootstrap-port = {BOOTSTRAP_PORT}\n'
                                                 f'disaggregation-transfer-backend = "mooncake"\n{extra_options}')
                + self.server_toml("decode", DECODE_PORT, mem, decode_gpus, "decode", shared,
                                   extra_options=f'disaggregation-transfer-backend = "mooncake"\n{extra_options}')
                + f"""
[router]
mode = "pd"
host = "127.0.0.1"
port = {ROUTER_PORT}
prefill = ["prefill"]
decode = ["decode"]
stop_timeout = 30
[router.options]
policy = "round_robin"
prometheus-host = "127.0.0.1"
prometheus-port = {METRICS_PORT}
""" + env_table("router", router_env))

    def profiles(self, gpus_decode: int) -> dict[str, str]:
        shared = gpus_decode == 0
        pd = self.pd_toml("real PD on one GPU: prefill + decode, mooncake over TCP, router in PD mode (issue 36)",
                          [0], [gpus_decode], shared, 0.2)
        tp1 = ('description = "one server on GPU 0, on the router\'s port (issue 36)"\ntakeover = true\nrollback = true\n'
               + self.server_toml("server", TP1_PORT, 0.5, [0]))
        bad = ('description = "tp1 whose server fails after its spawn (issue 36: the rollback)"\ntakeover = true\nrollback = true\n'
               + self.server_toml("server", TP1_PORT, 0.5, [0], model=self.bad_model, extra_env=BAD_ENV))
        return {"pd1": pd, "tp1": tp1, "tp1bad": bad}


def env_table(key: str, env: dict[str, str]) -> str:
    return f"[{key}.env]\n" + "".join(f'{k} = "{v}"\n' for k, v in env.items())


# ============================================================================ scenario helpers

class Clients:
    """N long /generate requests through the router, each on its own thread, started now."""

    def __init__(self, n: int, port: int = ROUTER_PORT, tokens: int = LONG_TOKENS, timeout: float = 120.0) -> None:
        self.results: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self.one, args=(i, port, tokens, timeout), daemon=True) for i in range(n)]
        for t in self.threads:
            t.start()

    def one(self, i: int, port: int, tokens: int, timeout: float) -> None:
        began = time.time()
        status, body, took = R.call("POST", port, "/generate", generate_body(tokens), timeout=timeout)
        with self.lock:
            self.results.append({"i": i, "t": began, "end": began + took, "status": status,
                                 "ok": status == 200 and tokens_in(body) > 0, "body": body[:200].decode(errors="replace")})

    def join(self, timeout: float = 150.0) -> dict[str, Any]:
        deadline = time.time() + timeout
        for t in self.threads:
            t.join(max(0.1, deadline - time.time()))
        done = [r for r in self.results if r["ok"]]
        cut = [r for r in self.results if not r["ok"]]
        return {"n": len(self.threads), "completed": len(done), "cut": len(cut),
                "unfinished": len(self.threads) - len(self.results), "cut_detail": cut[:4],
                "slowest_s": round(max((r["end"] - r["t"] for r in self.results), default=0.0), 2)}


def generate_body(tokens: int) -> dict[str, Any]:
    return {"text": "The capital city of France is", "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}}


def tokens_in(body: bytes) -> int:
    """Generated tokens in a /generate answer (completion_tokens, else output_ids), 0 if none or unreadable."""
    try:
        doc = json.loads(body)
    except ValueError:
        return 0
    doc = doc[0] if isinstance(doc, list) and doc else doc
    if not isinstance(doc, dict):
        return 0
    meta = doc.get("meta_info") or {}
    n = meta.get("completion_tokens") if isinstance(meta, dict) else None
    return int(n) if isinstance(n, int) else len(doc.get("output_ids") or [])


def wait_ready(run: PdRun, d: R.Daemon, timeout: float) -> float:
    """Seconds from the daemon's start to its instance READY (raises on failure or timeout)."""
    run.start_and_ready(d, R.Check(), {}, ROUTER_PORT, timeout=timeout)
    ready = d.find(lambda e: e["k"] == "ev" and e["kind"] == "instance" and e["state"] == "ready")[0]
    return round(ready["t"] - d.started_at, 1)


def router_workers(run: PdRun, instance: str) -> tuple[int | None, list[dict[str, Any]]]:
    """GET /workers on the router with the key the daemon gave it (RUNTIME_DIR/INSTANCE/router.key,
    root's to read): (status, the workers listed, with url, type and health)."""
    try:
        key: str | None = (run.work / "run" / instance / "router.key").read_text().strip()
    except OSError:
        key = None
    status, body, _ = R.call("GET", ROUTER_PORT, "/workers", timeout=10, key=key)
    try:
        doc = json.loads(body)
    except ValueError:
        return status, []
    items = doc.get("workers", doc) if isinstance(doc, dict) else doc
    out = []
    for w in items if isinstance(items, list) else []:
        if isinstance(w, dict):
            out.append({"url": w.get("url"), "type": w.get("worker_type"), "healthy": w.get("is_healthy"),
                        "status": w.get("status")})
    return status, out


def stop_timeline(d: R.Daemon, since: float, names: list[str]) -> dict[str, dict[str, float]]:
    """Per process: when its `stopped` came (s after `since`) and how long its stop took (the daemon's figure)."""
    out: dict[str, dict[str, float]] = {}
    for name in names:
        hits = d.says("stopped", since, name)
        if hits:
            e = hits[0]
            out[name] = {"stopped_at_s": round(e["t"] - since, 2),
                         "took_s": round(float(e["f"].get("GPUSUP_DURATION_S", "nan")), 2)}
    return out


def in_order(timeline: dict[str, dict[str, float]], order: list[str]) -> bool:
    times = [timeline[n]["stopped_at_s"] for n in order if n in timeline]
    return len(times) == len(order) and times == sorted(times)


def serves(c: R.Check, m: dict[str, Any], label: str) -> None:
    status, body, took = R.call("POST", ROUTER_PORT, "/generate", generate_body(16), timeout=60)
    n = tokens_in(body)
    m[f"{label}_generate"] = {"status": status, "tokens": n, "s": round(took, 3)}
    c(f"{label}: /generate through port {ROUTER_PORT} answers 200 with tokens", status == 200 and n > 0,
      {"status": status, "tokens": n, "body": body[:160].decode(errors="replace")})


def takeover(run: PdRun, c: R.Check, m: dict[str, Any], old: R.Daemon, profile: str, tag: str, old_procs: list[str],
             in_flight: int) -> R.Daemon:
    """The new profile's daemon takes the old one over with `in_flight` long requests through the router."""
    clients = Clients(in_flight) if in_flight else None
    time.sleep(0.5 if in_flight else 0.0)  # the requests reached the servers
    since = time.time()
    new = R.Daemon(run, profile, tag)
    m["ready_s"] = wait_ready(run, new, 300)
    rc_old = old.proc.wait(60)
    c("the old daemon stopped and exited 0", rc_old == 0, rc_old)
    tl = stop_timeline(old, since, old_procs)
    m["stops"] = tl
    c("stopped in order: " + " -> ".join(old_procs), in_order(tl, old_procs), tl)
    idle = new.find(lambda e: e["k"] == "say" and "verified idle" in e["msg"], since)
    spawn = new.says("spawn", since)
    m["verified_idle_at_s"] = round(idle[0]["t"] - since, 2) if idle else None
    m["verified_idle_line"] = idle[0]["msg"] if idle else None
    m["first_spawn_at_s"] = round(spawn[0]["t"] - since, 2) if spawn else None
    m["switch_to_ready_s"] = round(time.time() - since, 1)
    if m["first_spawn_at_s"] is not None:
        m["new_start_s"] = round(m["switch_to_ready_s"] - m["first_spawn_at_s"], 1)  # its spawn to READY
    trans = new.find(lambda e: e["k"] == "say" and ("transition" in e["msg"] or "verified idle" in e["msg"]
                                                    or e["f"].get("GPUSUP_EVENT") == "transition"), since)
    m["transition_lines"] = [(round(e["t"] - since, 2), e["msg"][:300]) for e in trans]
    c("GPU verified idle (the daemon's check) before the new profile's first spawn", bool(idle) and bool(spawn) and idle[0]["t"] <= spawn[0]["t"],
      {"idle_at_s": m["verified_idle_at_s"], "spawn_at_s": m["first_spawn_at_s"]})
    last_stop = max((v["stopped_at_s"] for v in tl.values()), default=None)
    if last_stop is not None and spawn:
        win = run.gpu.window(since + last_stop - 0.5, spawn[0]["t"] + 3.0)
        low = min((u for _, u, _ in win), default=None)
        m["gpu_min_between_mib"] = low
        c("the GPU read idle between the two layouts (direct reading)", low is not None and low - run.baseline <= R.IDLE_TOLERANCE_MIB,
          {"min_used_mib": low, "baseline": run.baseline, "samples": len(win)})
    if clients is not None:
        m["in_flight"] = clients.join()
        c(f"{in_flight} requests in flight: all completed, none cut", m["in_flight"]["completed"] == in_flight, m["in_flight"])
    return new


# ============================================================================ scenarios

def p1_start(run: PdRun, c: R.Check, m: dict[str, Any], d: R.Daemon, instance: str = "pd1") -> None:
    m["ready_s"] = wait_ready(run, d, 400)
    c(f"{instance} READY", True, f"{m['ready_s']} s after the daemon's start")
    status, workers = router_workers(run, instance)
    m["workers_at_ready"] = workers
    healthy = {w["type"] for w in workers if w["healthy"] is not False}
    c("at READY the router lists a prefill and a decode, healthy", {"prefill", "decode"} <= healthy, {"status": status, "workers": workers})
    serves(c, m, "first request after READY")  # the real router answered /health 200 before it had a prefill
    for name in ("prefill", "decode", "router"):
        ready = d.says("ready", 0, name)
        spawn = d.says("spawn", 0, name)
        m[f"{name}_spawn_at_s"] = round(spawn[0]["t"] - d.started_at, 1) if spawn else None
        m[f"{name}_ready_at_s"] = round(ready[0]["t"] - d.started_at, 1) if ready else None
    boot = [e["line"] for e in d.find(lambda e: e["k"] == "line" and e["p"] == "prefill" and "Bootstrap" in e["line"])]
    m["prefill_bootstrap_lines"] = boot[:3]
    if run.layout == "shared":  # one GPU for both: the second spawned only once the first was ready
        p_sp, p_rd, d_sp, d_rd = (m.get(f"{n}_{w}_at_s") for n in ("prefill", "decode") for w in ("spawn", "ready"))
        one_after = None not in (p_sp, p_rd, d_sp, d_rd) and (d_sp >= p_rd or p_sp >= d_rd)  # type: ignore[operator]
        c("the two servers sharing GPU 0 started one after another", one_after,
          {"prefill": (p_sp, p_rd), "decode": (d_sp, d_rd)})


def p2_generate(run: PdRun, c: R.Check, m: dict[str, Any]) -> None:
    serves(c, m, "router")
    status, body, _ = R.call("POST", DECODE_PORT, "/generate", generate_body(8), timeout=30)
    m["direct_to_decode"] = {"status": status, "body": body[:300].decode(errors="replace")}
    c("a direct /generate to the decode is refused (no bootstrap room)", status != 200 and b"bootstrap room" in body, m["direct_to_decode"])


def p5_rollback(run: PdRun, c: R.Check, m: dict[str, Any], d: R.Daemon, bad_profile: str = "tp1bad",
                pd: str = "pd1", tag: str = "p5") -> R.Daemon:
    """`bad_profile` takes `pd` over and fails after its spawn: exit 5 naming the rollback; `pd` started again."""
    since = time.time()
    bad = R.Daemon(run, bad_profile, f"{tag}-{bad_profile}")
    try:
        rc = bad.proc.wait(max(30.0, min(300.0, run.left() - 60)))
    except subprocess.TimeoutExpired:
        bad.stop(30)
        raise AssertionError(f"{bad_profile}'s daemon did not give up within 300 s") from None
    m[f"{bad_profile}_exit"] = rc
    m[f"{bad_profile}_s"] = round(time.time() - since, 1)
    reason = [e["msg"] for e in bad.find(lambda e: e["k"] == "ev" and e["kind"] == "instance" and e["state"] == "failed")]
    m[f"{bad_profile}_reason"] = reason[-1][:600] if reason else None
    c(f"{bad_profile}'s daemon exits 5 (a takeover that failed)", rc == 5, rc)
    c(f"its reason names the rollback of {pd}", bool(reason) and pd in reason[-1] and "roll" in reason[-1],
      m[f"{bad_profile}_reason"])
    c(f"{pd}'s daemon had stopped (taken over) and exited 0", d.proc.poll() == 0, d.proc.poll())
    m[f"{pd}_stops"] = stop_timeline(d, since, PD_STOP_ORDER)
    # no systemd here: what its StartUnit would do (the rollback's own attempt says it was not run by systemd)
    again = R.Daemon(run, pd, f"{tag}-{pd}-again")
    m[f"{pd}_ready_again_s"] = wait_ready(run, again, 300)
    c(f"{pd} READY again", True, f"{m[f'{pd}_ready_again_s']} s")
    serves(c, m, f"{pd} after the rollback")
    return again


def p6_stop(run: PdRun, c: R.Check, m: dict[str, Any], d: R.Daemon, in_flight: int, instance: str = "pd1") -> None:
    clients = Clients(in_flight)
    time.sleep(0.5)
    since = time.time()
    run.idle_after_stop(c, m, d, instance, PD_STOP_ORDER)
    tl = stop_timeline(d, since, PD_STOP_ORDER)
    m["stops"] = tl
    c("stopped in order: router -> decode -> prefill", in_order(tl, PD_STOP_ORDER), tl)
    m["in_flight"] = clients.join()
    c(f"{in_flight} requests in flight: all completed, none cut", m["in_flight"]["completed"] == in_flight, m["in_flight"])


# ============================================================================ the group

def group(run: PdRun) -> None:
    est = run.args.start_estimate
    n = run.args.in_flight
    holder: dict[str, R.Daemon] = {}
    d = R.Daemon(run, "pd1", "p1-pd1")
    holder["live"] = d
    run.scenario("p1_start", "pd1 to READY: the router has both workers and a first request through it succeeds", 2 * est,
                 lambda c, m: p1_start(run, c, m, d))
    if not d.find(lambda e: e["k"] == "ev" and e["kind"] == "instance" and e["state"] == "ready"):
        run.args.reserve = 0
        run.scenario("p6_stop", "stop pd1", 20, lambda c, m: p6_stop(run, c, m, d, 0))
        return
    run.scenario("p2_generate", "/generate through the router; a direct one to the decode refused", 10,
                 lambda c, m: p2_generate(run, c, m))

    def switch(c: R.Check, m: dict[str, Any], profile: str, tag: str, procs: list[str], flight: int) -> None:
        new = takeover(run, c, m, holder["live"], profile, tag, procs, flight)
        holder["live"] = new
        serves(c, m, profile)

    run.scenario("p3_switch", f"pd1 -> tp1 with {n} long requests in flight: ordered stops, GPU idle between", est + 30,
                 lambda c, m: switch(c, m, "tp1", "p3-tp1", PD_STOP_ORDER, n))
    if holder["live"].profile == "tp1":
        run.scenario("p4_back", "tp1 -> pd1", 2 * est + 15, lambda c, m: switch(c, m, "pd1", "p4-pd1", ["server"], 0))
    if holder["live"].profile == "pd1":
        def rollback(c: R.Check, m: dict[str, Any]) -> None:
            holder["live"] = p5_rollback(run, c, m, holder["live"])

        run.scenario("p5_rollback", "tp1bad fails after its spawn: rolled back, pd1 serves again", 3 * est, rollback)
    run.args.reserve = 0
    live = holder["live"]
    if live.profile == "pd1" and live.proc.poll() is None:
        run.scenario("p6_stop", f"stop pd1 with {n} long requests in flight: router, decode, prefill; GPU at baseline", 30,
                     lambda c, m: p6_stop(run, c, m, live, n))
    elif live.proc.poll() is None:
        run.scenario("p6_stop", f"stop {live.profile} (pd1 was not running)", 30,
                     lambda c, m: run.idle_after_stop(c, m, live, live.profile, ["server"]))


def cmd_run(args: argparse.Namespace, make_run: Any = PdRun, run_group: Any = None) -> int:
    """Set up `make_run(args)` and run `run_group` (this file's group) on it; exit 0 when every scenario passed."""
    if args.mode == "real" and args.router == "standin":
        print("--router standin is for --mode standin only", file=sys.stderr)
        return 2
    run = make_run(args)
    try:
        run.setup()
    except Exception as e:
        run.results["setup"]["error"] = traceback.format_exc()[-4000:]
        run.save()
        print(f"set-up failed: {e}", flush=True)
        return 2
    print(f"set-up: {json.dumps({k: v for k, v in run.results['setup'].items() if k not in ('config', 'profiles')}, default=str)}", flush=True)
    try:
        (run_group or group)(run)
    finally:
        code = run.finish()
    return code


def parsers(description: str, start_estimate: float, always: str) -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The command line (`unpack`, `run`) and its `run` subparser, to which real_multi.py adds its options."""
    ap = argparse.ArgumentParser(description=description)
    sub = ap.add_subparsers(dest="command", required=True)
    u = sub.add_parser("unpack", help="extract the bundles present into /tmp/sgl/<name>/ (skips those there)")
    u.add_argument("--dest", default="/tmp/sgl")
    u.add_argument("--python", default=None)
    r = sub.add_parser("run")
    r.add_argument("--mode", choices=("real", "standin"), required=True)
    r.add_argument("--router", choices=tuple(ROUTER_MODULES), required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--in-flight", type=int, default=8, help="long requests in flight during the switch and the stop")
    r.add_argument("--start-estimate", type=float, default=start_estimate, help="seconds one server start may take (budget planning)")
    r.add_argument("--budget", type=float, default=570.0, help="seconds this run may take (the device allows 600 a command)")
    r.add_argument("--reserve", type=float, default=40.0, help="seconds kept for the final stop")
    r.add_argument("--unpack", default="/tmp/sgl", help="where `unpack` put the bundles and the model")
    r.add_argument("--work", default=None)
    r.add_argument("--python", default=None, help="the python of the daemon and the servers (default: this one)")
    r.add_argument("--only", type=lambda v: set(v.split(",")), default=set(),
                   help=f"run only these scenarios (comma-separated keys; {always})")
    r.add_argument("--standin-startup", type=float, default=3.0, help="the stand-in's loading time (seconds)")
    return ap, r


def main() -> int:
    ap, _ = parsers(__doc__.split("\n\n")[0], 60.0, "p1_start always runs")
    args = ap.parse_args()
    if args.command == "unpack":
        return cmd_unpack(args)
    args.code, args.sgl = "tree", str(R.SGL)
    args.only = args.only | {"p1_start"} if args.only else set()  # the rest need pd1 started
    return cmd_run(args)


if __name__ == "__main__":
    sys.exit(main())
