"""MPS facts on a real GPU: what docs/mps.md records under "Facts seen on real GPUs".

``python -m tests.real_gpu.mps_facts <work dir>`` runs NVIDIA's control daemon in pipe
directories under <work dir> (one scenario at a time; every daemon is quit or killed before the
next; only processes serving a pipe directory under <work dir>, and the servers they started,
are ever listed or killed) and prints one JSON document: per scenario, what it did and what it
saw. It never changes MIG or compute mode. Clients are `tests.real_gpu.cuda_client`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

NOBODY = 65534
CLIENT = [sys.executable, "-m", "tests.real_gpu.cuda_client"]
"""The client; `main` points it at a world-readable copy, so other UIDs can run it too."""


def control_binary() -> str:
    for candidate in (
        shutil.which("nvidia-cuda-mps-control"),
        "/usr/local/nvidia/bin/nvidia-cuda-mps-control",
        "/usr/bin/nvidia-cuda-mps-control",
    ):
        if candidate and Path(candidate).exists():
            return candidate
    raise SystemExit("no nvidia-cuda-mps-control")


CONTROL = control_binary()


def listing(directory: Path) -> list[str]:
    if not directory.exists():
        return ["<missing>"]
    found = []
    for path in sorted(directory.iterdir()):
        info = path.lstat()
        kind = {
            stat.S_IFSOCK: "socket",
            stat.S_IFIFO: "fifo",
            stat.S_IFDIR: "dir",
            stat.S_IFREG: "file",
            stat.S_IFLNK: "link",
        }.get(stat.S_IFMT(info.st_mode), "other")
        found.append(
            f"{path.name} {kind} {stat.filemode(info.st_mode)} {info.st_uid}:{info.st_gid}"
        )
    return found


MPS_NAMES = ("nvidia-cuda-mps", "nvidia_cuda_mps")
WORK: list[Path] = []
"""The work directory `main` was given: only MPS processes serving a pipe directory under it (and
the servers they started) are listed and killed, never another run's or another user's."""


def _ours(proc: Path, status: str, ours: set[str]) -> bool:
    ppid = next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:"))
    if ppid in ours:
        return True
    try:
        environ = (proc / "environ").read_bytes().split(b"\0")
    except OSError:
        return False
    prefix = f"CUDA_MPS_PIPE_DIRECTORY={WORK[0]}/".encode() if WORK else None
    return prefix is not None and any(entry.startswith(prefix) for entry in environ)


def mps_processes() -> list[str]:
    """``<pid> <comm> uid=… ppid=… argv=…`` of each of this run's MPS processes (`WORK`)."""
    candidates = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            names = [Path(arg.decode(errors="replace")).name for arg in argv]
            comm = (proc / "comm").read_text().strip()
            if any(n.startswith(MPS_NAMES) for n in [comm, *names]):  # the double is a script
                candidates.append((proc, (proc / "status").read_text()))
        except OSError:
            continue
    ours: set[str] = set()
    for _ in range(2):  # daemons first, then the servers they started
        ours |= {p.name for p, status in candidates if _ours(p, status, ours)}
    found = []
    for proc, status in candidates:
        if proc.name not in ours:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        uid, ppid = fields["Uid"].split()[0], fields["PPid"].strip()
        try:
            argv = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except OSError:
            continue
        comm = fields["Name"].strip()
        found.append(f"{proc.name} {comm} uid={uid} ppid={ppid} argv={argv!r}")
    return sorted(found)


def kill_all_mps() -> list[str]:
    killed = mps_processes()
    for entry in killed:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(entry.split()[0]), signal.SIGKILL)
    time.sleep(0.5)
    return killed


class Daemon:
    def __init__(self, base: Path) -> None:
        self.pipe = base / "pipe"
        self.log = base / "log"
        self.pipe.mkdir(parents=True, exist_ok=True)
        self.log.mkdir(parents=True, exist_ok=True)
        self.env = dict(
            os.environ, CUDA_MPS_PIPE_DIRECTORY=str(self.pipe), CUDA_MPS_LOG_DIRECTORY=str(self.log)
        )

    def start(self, *options: str) -> dict[str, Any]:
        done = subprocess.run(
            [CONTROL, "-d", *options],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
        time.sleep(0.5)
        return {"rc": done.returncode, "out": (done.stdout + done.stderr).strip()[-500:]}

    def command(self, text: str, *, uid: int | None = None, timeout: float = 15) -> dict[str, Any]:
        started = time.monotonic()
        try:
            done = subprocess.run(
                [CONTROL],
                input=text + "\n",
                env=self.env,
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
                preexec_fn=as_user(uid),
            )
        except subprocess.TimeoutExpired:
            return {"command": text, "uid": uid, "timeout": timeout}
        return {
            "command": text,
            "uid": uid if uid is not None else os.getuid(),
            "rc": done.returncode,
            "out": (done.stdout + done.stderr).strip()[-500:],
            "seconds": round(time.monotonic() - started, 2),
        }

    def client(
        self,
        *args: str,
        env: dict[str, str] | None = None,
        uid: int | None = None,
        timeout: float = 60,
    ) -> dict[str, Any]:
        return run_client(list(args), dict(self.env, **(env or {})), uid=uid, timeout=timeout)

    def spawn_client(self, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [*CLIENT, *args],
            env=dict(self.env, **(env or {})),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def log_tail(self) -> list[str]:
        lines: list[str] = []
        for name in ("control.log", "server.log"):
            path = self.log / name
            if path.exists():
                lines += [f"{name}: {line}" for line in path.read_text().splitlines()[-15:]]
        return lines

    def quit(self) -> dict[str, Any]:
        result = self.command("quit", timeout=20)
        deadline = time.monotonic() + 10
        while mps_processes() and time.monotonic() < deadline:
            time.sleep(0.2)
        result["left"] = mps_processes()
        return result


def as_user(uid: int | None) -> Callable[[], None] | None:
    if uid is None:
        return None

    def switch() -> None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)

    return switch


def run_client(
    args: list[str],
    env: dict[str, str],
    *,
    uid: int | None = None,
    timeout: float = 60,
    wrap: list[str] | None = None,
) -> dict[str, Any]:
    started = time.monotonic()
    client = list(CLIENT)
    if uid is not None and Path("/usr/bin/python3").exists():
        client[0] = "/usr/bin/python3"  # the caller's may sit in a directory only it can read
    try:
        done = subprocess.run(
            [*(wrap or []), *client, *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            preexec_fn=as_user(uid),
        )
    except subprocess.TimeoutExpired as expired:
        return {"timeout": timeout, "stderr": str(expired.stderr)[-300:]}
    return finished(done.returncode, done.stdout, done.stderr, time.monotonic() - started)


def finished(rc: int, out: str, err: str, seconds: float) -> dict[str, Any]:
    lines = out.strip().splitlines()
    try:
        report = json.loads(lines[-1]) if lines else {}
    except json.JSONDecodeError:
        report = {"stdout": out[-300:]}
    return {"rc": rc, "seconds": round(seconds, 2), "report": report, "stderr": err.strip()[-300:]}


def collect(process: subprocess.Popen[str], timeout: float = 60) -> dict[str, Any]:
    started = time.monotonic()
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        return {"timeout": timeout, **finished(process.returncode, out, err, 0)}
    return finished(process.returncode, out, err, time.monotonic() - started)


def shm() -> list[str]:
    return listing(Path("/dev/shm"))


# ---- scenarios ---------------------------------------------------------------------------------


def limits(work: Path) -> dict[str, Any]:
    """Pinned memory limit and active thread percentage per client; files in the pipe dir and
    /dev/shm; a daemon-wide default pinned limit."""
    daemon = Daemon(work / "limits")
    out: dict[str, Any] = {"shm before": shm(), "start": daemon.start()}
    out["pipe dir after start"] = listing(daemon.pipe)
    out["no limits"] = daemon.client("--alloc", "1024")
    out["processes with a server"] = mps_processes()
    out["pipe dir with a server"] = listing(daemon.pipe)
    out["shm with a server"] = shm()
    pinned = {"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=2048M"}
    out["pinned 2048M, alloc 1536"] = daemon.client("--alloc", "1536", env=pinned)
    out["pinned 2048M, alloc 3072"] = daemon.client("--alloc", "3072", env=pinned)
    out["pinned 2048M, alloc 1536 then 1024"] = daemon.client(
        "--alloc", "1536", "--alloc", "1024", env=pinned
    )
    threads = {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25"}
    out["active threads 25%"] = daemon.client(env=threads)
    out["get_server_list"] = daemon.command("get_server_list")
    out["set_default_device_pinned_mem_limit 0 1G"] = daemon.command(
        "set_default_device_pinned_mem_limit 0 1G"
    )
    out["default pinned 1G (new server?), alloc 1536"] = daemon.client("--alloc", "1536")
    out["default pinned 1G, client env 4G, alloc 3072"] = daemon.client(
        "--alloc", "3072", env={"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=4G"}
    )
    out["log"] = daemon.log_tail()
    out["quit"] = daemon.quit()
    out["pipe dir after quit"] = listing(daemon.pipe)
    out["shm after quit"] = shm()
    return out


def mounts(work: Path) -> dict[str, Any]:
    """Clients through a read-only bind of the pipe directory, and through `control` alone."""
    daemon = Daemon(work / "mounts")
    out: dict[str, Any] = {"start": daemon.start()}
    out["warm server"] = daemon.client("--alloc", "64")
    readonly = work / "mounts-ro"
    readonly.mkdir()
    script = (
        f"mount --bind {daemon.pipe} {readonly} && mount -o remount,bind,ro {readonly} && "
        f'touch {readonly}/probe 2>/dev/null; echo touch-rc=$? >&2; exec "$@"'
    )
    wrap = ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh"]
    env = dict(daemon.env, CUDA_MPS_PIPE_DIRECTORY=str(readonly))
    out["read-only pipe dir"] = run_client(["--alloc", "64"], env, wrap=wrap)
    only = work / "mounts-control-only"
    only.mkdir()
    (only / "control").touch()
    script = f'mount --bind {daemon.pipe}/control {only}/control && exec "$@"'
    wrap = ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh"]
    env = dict(daemon.env, CUDA_MPS_PIPE_DIRECTORY=str(only))
    out["control socket alone"] = run_client(["--alloc", "64"], env, wrap=wrap)
    out["control dir after"] = listing(only)
    out["pipe dir after"] = listing(daemon.pipe)
    out["log"] = daemon.log_tail()
    out["quit"] = daemon.quit()
    return out


def other_user(work: Path) -> dict[str, Any]:
    """Control commands and a client from a UID other than the daemon's (no -multiuser)."""
    daemon = Daemon(work / "users")
    out: dict[str, Any] = {"start": daemon.start()}
    out["server as root"] = daemon.client("--alloc", "64")
    out["pipe dir"] = listing(daemon.pipe)
    out["nobody: get_default_active_thread_percentage (dir as made)"] = daemon.command(
        "get_default_active_thread_percentage", uid=NOBODY
    )
    for path in [daemon.pipe, *daemon.pipe.iterdir()]:
        path.chmod(0o777 if path.is_dir() else 0o666)
    out["pipe dir opened"] = listing(daemon.pipe)
    out["nobody: get_server_list"] = daemon.command("get_server_list", uid=NOBODY)
    out["nobody: set_default_active_thread_percentage 10"] = daemon.command(
        "set_default_active_thread_percentage 10", uid=NOBODY
    )
    out["root: get_default_active_thread_percentage"] = daemon.command(
        "get_default_active_thread_percentage"
    )
    out["root: set back 100"] = daemon.command("set_default_active_thread_percentage 100")
    holder = daemon.spawn_client("--alloc", "64", "--sleep", "12")
    time.sleep(3)
    out["nobody client while a root client runs (20 s)"] = daemon.client(
        "--alloc", "64", uid=NOBODY, timeout=20
    )
    out["root holder"] = collect(holder)
    out["nobody: quit"] = daemon.command("quit", uid=NOBODY)
    time.sleep(1)
    out["processes after nobody's quit"] = mps_processes()
    out["log"] = daemon.log_tail()
    out["quit"] = daemon.quit()
    return out


def quit_with_client(work: Path) -> dict[str, Any]:
    """`quit` while a client holds a context: what the client sees, how long quit takes."""
    daemon = Daemon(work / "quit")
    out: dict[str, Any] = {"start": daemon.start()}
    holder = daemon.spawn_client("--alloc", "256", "--sleep", "8", "--then-alloc", "256")
    time.sleep(3)
    out["processes before quit"] = mps_processes()
    out["quit"] = daemon.command("quit", timeout=30)
    out["processes 1 s after quit"] = (time.sleep(1), mps_processes())[1]
    out["client"] = collect(holder)
    deadline = time.monotonic() + 10
    while mps_processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    out["processes after the client"] = mps_processes()
    out["pipe dir"] = listing(daemon.pipe)
    out["log"] = daemon.log_tail()
    out["killed"] = kill_all_mps()
    return out


def restart_in_place(work: Path) -> dict[str, Any]:
    """SIGKILL the daemon (control and server) under a client; a new daemon in the same dir."""
    daemon = Daemon(work / "restart")
    out: dict[str, Any] = {"start": daemon.start()}
    holder = daemon.spawn_client(
        "--alloc", "256", "--sleep", "10", "--then-alloc", "256", "--then-work"
    )
    time.sleep(3)
    out["killed"] = kill_all_mps()
    out["pipe dir left"] = listing(daemon.pipe)
    out["restart in the same dir"] = daemon.start()
    out["pipe dir after restart"] = listing(daemon.pipe)
    out["new client"] = daemon.client("--alloc", "64")
    out["old client"] = collect(holder)
    out["log"] = daemon.log_tail()
    out["quit"] = daemon.quit()
    return out


def tamper(work: Path) -> dict[str, Any]:
    """A tenant with the pipe dir writable removes `control`: other clients, the daemon."""
    daemon = Daemon(work / "tamper")
    out: dict[str, Any] = {"start": daemon.start()}
    out["warm server"] = daemon.client("--alloc", "64")
    (daemon.pipe / "control").unlink()
    out["pipe dir without control"] = listing(daemon.pipe)
    out["client after control removed (20 s)"] = daemon.client("--alloc", "64", timeout=20)
    out["processes"] = mps_processes()
    out["killed"] = kill_all_mps()
    return out


def gpu_uuid() -> str:
    done = subprocess.run(
        ["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader", "-i", "0"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return done.stdout.strip()


def uuid_limits(work: Path) -> dict[str, Any]:
    """What gpu-dra sends: daemon defaults keyed by the GPU's UUID before the server starts
    (``set_default_device_pinned_mem_limit <uuid> <N>M``, a thread percentage), and the
    client variable keyed by UUID; how much of a pinned limit a context itself takes."""
    uuid = gpu_uuid()
    daemon = Daemon(work / "uuid")
    out: dict[str, Any] = {"uuid": uuid, "start": daemon.start()}
    out["set pinned 2048M by uuid"] = daemon.command(
        f"set_default_device_pinned_mem_limit {uuid} 2048M"
    )
    out["get pinned by uuid"] = daemon.command(f"get_default_device_pinned_mem_limit {uuid}")
    out["set threads 50"] = daemon.command("set_default_active_thread_percentage 50")
    out["alloc 1024"] = daemon.client("--alloc", "1024")
    out["alloc 3072"] = daemon.client("--alloc", "3072")
    env = {"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"{uuid}=1024M"}
    out["client uuid=1024M, alloc 256"] = daemon.client("--alloc", "256", env=env)
    out["client uuid=1024M, alloc 768"] = daemon.client("--alloc", "768", env=env)
    env = {"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"{uuid}=4096M"}
    out["client uuid=4096M over default 2048M, alloc 3072"] = daemon.client(
        "--alloc", "3072", env=env
    )
    out["client threads 100 over default 50"] = daemon.client(
        env={"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100"}
    )
    out["get_server_list"] = daemon.command("get_server_list")
    servers = out["get_server_list"].get("out", "").split()
    if servers:
        server = servers[0]
        out["get_device_pinned_mem_limit"] = daemon.command(
            f"get_device_pinned_mem_limit {server} {uuid}"
        )
        out["set_device_pinned_mem_limit 512M on the running server"] = daemon.command(
            f"set_device_pinned_mem_limit {server} {uuid} 512M"
        )
        out["after: alloc 1024"] = daemon.client("--alloc", "1024")
    out["log"] = daemon.log_tail()
    out["quit"] = daemon.quit()
    return out


def tamper_as_tenant(work: Path) -> dict[str, Any]:
    """A non-root tenant with the pipe dir writable (no read-only mount) removes `control`."""
    daemon = Daemon(work / "tamper-tenant")
    out: dict[str, Any] = {"start": daemon.start()}
    daemon.pipe.chmod(0o777)
    out["tenant client"] = daemon.client("--alloc", "64", uid=NOBODY)
    removed = subprocess.run(
        ["rm", "-f", str(daemon.pipe / "control")],
        capture_output=True,
        text=True,
        timeout=10,
        check=False,
        preexec_fn=as_user(NOBODY),
    )
    out["tenant rm control"] = {"rc": removed.returncode, "err": removed.stderr.strip()}
    out["pipe dir"] = listing(daemon.pipe)
    out["next tenant client (20 s)"] = daemon.client("--alloc", "64", uid=NOBODY, timeout=20)
    out["root client (20 s)"] = daemon.client("--alloc", "64", timeout=20)
    out["log"] = daemon.log_tail()
    out["processes"] = mps_processes()
    return out


def tenant_views(work: Path) -> dict[str, Any]:
    """A non-root tenant through a read-only bind of the pipe dir; and `control` removed before
    any server runs."""
    daemon = Daemon(work / "tenant-views")
    out: dict[str, Any] = {"start": daemon.start()}
    readonly = work / "tenant-views-ro"
    readonly.mkdir()
    script = (
        f"mount --bind {daemon.pipe} {readonly} && mount -o remount,bind,ro {readonly} && "
        'exec setpriv --reuid=65534 --regid=65534 --clear-groups "$@"'
    )
    wrap = ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh"]
    env = dict(daemon.env, CUDA_MPS_PIPE_DIRECTORY=str(readonly))
    client = ["/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable]
    started = time.monotonic()
    done = subprocess.run(
        [*wrap, *client, CLIENT[1], "--alloc", "64"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    out["tenant (uid 65534) through a read-only pipe dir"] = finished(
        done.returncode, done.stdout, done.stderr, time.monotonic() - started
    )
    out["quit"] = daemon.quit()
    fresh = Daemon(work / "no-control")
    out["fresh start"] = fresh.start()
    (fresh.pipe / "control").unlink()
    out["fresh pipe dir without control"] = listing(fresh.pipe)
    out["root client, no server yet, no control (20 s)"] = fresh.client("--alloc", "64", timeout=20)
    fresh.pipe.chmod(0o777)
    out["tenant client, no control (20 s)"] = fresh.client("--alloc", "64", uid=NOBODY, timeout=20)
    out["log"] = fresh.log_tail()
    out["processes"] = mps_processes()
    return out


def multiuser(work: Path) -> dict[str, Any]:
    """gpu-dra's daemon: ``-d -M`` with UUID-keyed defaults. Tenants of another UID: at the same
    time as root's clients? their commands? the invisible-GPU entry of the client variable."""
    uuid = gpu_uuid()
    daemon = Daemon(work / "multiuser")
    out: dict[str, Any] = {"start -M": daemon.start("-M")}
    out["set pinned 2048M"] = daemon.command(f"set_default_device_pinned_mem_limit {uuid} 2048M")
    out["set threads 50"] = daemon.command("set_default_active_thread_percentage 50")
    daemon.pipe.chmod(0o755)
    holder = daemon.spawn_client("--alloc", "64", "--sleep", "8")
    time.sleep(2)
    out["tenant client while root's runs (20 s)"] = daemon.client(
        "--alloc", "1024", uid=NOBODY, timeout=20
    )
    out["tenant client alloc 3072"] = daemon.client("--alloc", "3072", uid=NOBODY, timeout=20)
    out["ps"] = daemon.command("ps")
    out["tenant: get_default_active_thread_percentage"] = daemon.command(
        "get_default_active_thread_percentage", uid=NOBODY
    )
    out["tenant: set_default_active_thread_percentage 10"] = daemon.command(
        "set_default_active_thread_percentage 10", uid=NOBODY
    )
    out["root: get_default_active_thread_percentage"] = daemon.command(
        "get_default_active_thread_percentage"
    )
    out["tenant: quit"] = daemon.command("quit", uid=NOBODY)
    time.sleep(1)
    out["processes after the tenant's quit"] = mps_processes()
    for label, value in (
        ("ordinal 0=1G,1=4G", "0=1G,1=4G"),
        ("uuid=1G plus an unknown uuid", f"{uuid}=1G,GPU-00000000-0000-0000-0000-000000000000=4G"),
        ("ordinal 1=4G only", "1=4G"),
    ):
        out[f"client variable {label}, alloc 3072"] = daemon.client(
            "--alloc", "3072", env={"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": value}
        )
    out["root holder"] = collect(holder)
    out["log"] = daemon.log_tail()
    out["quit"] = daemon.quit()
    return out


SCENARIOS = {
    "multiuser": multiuser,
    "tenant views": tenant_views,
    "uuid limits": uuid_limits,
    "tamper as a tenant": tamper_as_tenant,
    "limits": limits,
    "mounts": mounts,
    "other user": other_user,
    "quit with a client": quit_with_client,
    "restart in place": restart_in_place,
    "tamper": tamper,
}


def main(argv: list[str]) -> int:
    work = Path(argv[0])
    only = argv[1:] or list(SCENARIOS)
    work.mkdir(parents=True, exist_ok=True)
    work.chmod(0o755)
    WORK[:] = [work.resolve()]
    client = work / "cuda_client.py"
    shutil.copy(Path(__file__).with_name("cuda_client.py"), client)
    client.chmod(0o644)
    CLIENT[1:] = [str(client)]
    results: dict[str, Any] = {"control": CONTROL, "leftover at start": kill_all_mps()}
    for name in only:
        started = time.monotonic()
        try:
            results[name] = SCENARIOS[name](work)
        except Exception as error:
            results[name] = {"error": f"{type(error).__name__}: {error}"}
        finally:
            results[name + " left"] = kill_all_mps()
            results[name + " seconds"] = round(time.monotonic() - started, 1)
        print(
            f"mps_facts: {name} done in {results[name + ' seconds']} s", file=sys.stderr, flush=True
        )
    print(json.dumps(results, indent=1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
