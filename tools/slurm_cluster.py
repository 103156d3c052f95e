#!/usr/bin/env python3
"""A throw-away SLURM cluster of N nodes on this machine: munge, slurmctld and one slurmd per node, all under
one temporary directory. Each node is its own host: its own hostname and /etc/hosts (a UTS and mount
namespace) and its own network namespace, with an address on a bridge (10.77.0.1 the controller, 10.77.0.11,
.12, ... the nodes). Needs root and Debian's slurmctld, slurmd, slurm-client and munge (SLURM 22.05).

    tools/slurm_cluster.py up DIR [--nodes 2] [--second-interface]   # prints `export SLURM_CONF=DIR/bert-recipes-slurm.conf`
    tools/slurm_cluster.py down DIR          # cancels the jobs, stops every daemon by PID, removes the network
    tools/slurm_cluster.py kill-node DIR n2  # SIGKILL every process of node n2 (its sockets reset)
    tools/slurm_cluster.py silence-node DIR n2   # n2's link down inside its namespace: nothing is reset
    tools/slurm_cluster.py revive-node DIR n2    # link up, slurmd started again, node back in service
    tools/slurm_cluster.py leftovers         # anything a cluster left behind (daemons, namespaces, links); exit 1

--second-interface gives each node a second interface (eth1, a veth whose far end stays in the node, holding 10.78.0.1x: it reaches nobody) and makes
the node's own hostname resolve to it: the way a node whose hostname names its management network makes gloo and
NCCL pick the wrong interface. One cluster at a time on a machine: the ports (6917-6927) and subnets are fixed.
Preemption: a job of the `urgent` partition preempts the `debug` partition's jobs (PreemptMode=REQUEUE), which
get their --signal (USR1 for slurm/*.sbatch) at once and 30 s of grace (preempt_send_user_signal, GraceTime=30).
Each node's DIR/local is its own directory (DIR/nodes/<node>/local bound there): a node-local disk.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

CTL_PORT, NODE_PORT = 6917, 6918
BRIDGE, VETH, SUBNET, SECOND = "bslurm0", "bsl", "10.77.0", "10.78.0"
MARK = "bert-recipes-slurm"   # in every daemon's command line (its config's name), for `leftovers`
CONF, MUNGE = f"{MARK}.conf", f"{MARK}-munge"
WRAP = f"# {MARK}"


def sh(*cmd, check=True, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], check=check, capture_output=True, text=True, **kw)


def missing() -> str | None:
    """Why a cluster cannot start here (one line), or None."""
    if os.geteuid() != 0:
        return "the SLURM cluster needs root (namespaces, a bridge, munge as its user)"
    for exe in ("slurmctld", "slurmd", "sbatch", "munged", "munge", "nsenter", "unshare", "ip"):
        if shutil.which(exe) is None and not Path(f"/usr/sbin/{exe}").exists():
            return (f"{exe} not found: apt-get install --no-install-recommends slurmctld slurmd slurm-client munge "
                    "(SLURM 22.05)")
    return None


def env(d: Path) -> dict:
    return {**os.environ, "SLURM_CONF": str(d / CONF)}


def nodes_of(d: Path) -> list[str]:
    return list(json.loads((d / "state.json").read_text())["nodes"])


def write_config(d: Path, n: int) -> None:
    mem = max(1024, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20 // (2 * n))
    nodes = "\n".join(f"NodeName=n{i} NodeHostname=n{i} NodeAddr={SUBNET}.{10 + i} Port={NODE_PORT + i} CPUs=4 "
                      f"RealMemory={mem} State=UNKNOWN" for i in range(1, n + 1))
    (d / CONF).write_text(f"""{WRAP}: written by tools/slurm_cluster.py
ClusterName=bertrecipes
SlurmctldHost={socket.gethostname()}({SUBNET}.1)
SlurmctldPort={CTL_PORT}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d}/{MUNGE}/munge.socket.2,cred_expire=10
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
MailProg=/bin/true
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
SchedulerParameters=sched_interval=1,bf_interval=1
ReturnToService=2
JobRequeue=1
KillWait=5
InactiveLimit=0
MinJobAge=300
SlurmdTimeout=10
MessageTimeout=5
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
SlurmctldParameters=preempt_send_user_signal
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP PriorityTier=1 GraceTime=30
PartitionName=urgent Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=2
""")


def hosts_file(d: Path, n: int, own: int, second: bool) -> Path:
    lines = ["127.0.0.1 localhost", f"{SUBNET}.1 {socket.gethostname()}"]
    lines += [f"{SECOND if second and i == own else SUBNET}.{10 + i} n{i}" for i in range(1, n + 1)]
    path = d / "nodes" / f"n{own}" / "hosts"
    path.write_text("\n".join(lines) + "\n")
    return path


def start_munge(d: Path) -> int:
    m = d / MUNGE
    m.mkdir()
    shutil.chown(m, "munge", "munge")
    key = m / "munge.key"
    key.write_bytes(os.urandom(1024))
    shutil.chown(key, "munge", "munge")
    key.chmod(0o400)
    sh("setpriv", "--reuid=munge", "--regid=munge", "--init-groups", "munged", f"--key-file={key}",
       f"--socket={m}/munge.socket.2", f"--pid-file={m}/munged.pid", f"--log-file={m}/munged.log",
       f"--seed-file={m}/munged.seed")
    for _ in range(50):
        if (m / "munged.pid").exists() and (m / "munged.pid").read_text().strip():
            return int((m / "munged.pid").read_text())
        time.sleep(0.1)
    raise RuntimeError(f"munged did not start: {m}/munged.log")


def start_node(d: Path, i: int, n: int, second: bool, state: dict) -> None:
    """The node's namespaces (held by a sleeping process), its link to the bridge, then its slurmd."""
    name, nd = f"n{i}", d / "nodes" / f"n{i}"
    (nd / "local").mkdir(parents=True, exist_ok=True)
    hosts = hosts_file(d, n, i, second)
    holder = subprocess.Popen(["unshare", "--net", "--uts", "--mount", "--propagation", "private",
                               "bash", "-c", f"hostname {name} && mount --bind {hosts} /etc/hosts && "
                               f"mount --bind {nd / 'local'} {d / 'local'} && exec -a {MARK}-node-{name} sleep infinity"],
                              start_new_session=True)
    state["nodes"][name] = holder.pid
    save(d, state)
    for _ in range(100):   # until hostname and mounts are in place
        if sh("nsenter", "-t", holder.pid, "--uts", "hostname", check=False).stdout.strip() == name and \
                sh("nsenter", "-t", holder.pid, "--mount", "cat", "/etc/hosts", check=False).stdout == hosts.read_text():
            break
        time.sleep(0.05)
    host_end, node_end = f"{VETH}{i}h", f"{VETH}{i}n"
    sh("ip", "link", "add", host_end, "type", "veth", "peer", "name", node_end)
    sh("ip", "link", "set", node_end, "netns", holder.pid)
    sh("ip", "link", "set", host_end, "master", BRIDGE, "up")
    net = ["nsenter", "-t", holder.pid, "--net"]
    sh(*net, "ip", "link", "set", "lo", "up")
    sh(*net, "ip", "link", "set", node_end, "name", "eth0")
    sh(*net, "ip", "addr", "add", f"{SUBNET}.{10 + i}/24", "dev", "eth0")
    sh(*net, "ip", "link", "set", "eth0", "up")
    if second:
        sh(*net, "ip", "link", "add", "eth1", "type", "veth", "peer", "name", "eth1p")   # its far end in the node
        sh(*net, "ip", "link", "set", "eth1p", "up")
        sh(*net, "ip", "addr", "add", f"{SECOND}.{10 + i}/24", "dev", "eth1")
        sh(*net, "ip", "link", "set", "eth1", "up")
    start_slurmd(d, name, holder.pid)


def start_slurmd(d: Path, name: str, holder: int) -> None:
    (d / "spool" / name).mkdir(parents=True, exist_ok=True)
    log = open(d / f"slurmd-{name}.out", "a")
    subprocess.Popen(["nsenter", "-t", str(holder), "--net", "--uts", "--mount", "slurmd", "-D", "-N", name,
                      "-f", str(d / CONF)], stdout=log, stderr=log, start_new_session=True)


def up(d: Path, n: int = 2, second_interface: bool = False, timeout: float = 30) -> dict:
    """Starts the cluster in d (created, must be empty or absent); returns the environment for its clients."""
    why = missing()
    if why:
        raise RuntimeError(why)
    if leftovers():
        raise RuntimeError("another cluster is up on this machine (tools/slurm_cluster.py leftovers)")
    d.mkdir(parents=True, exist_ok=True)
    d.chmod(0o755)   # munged runs as munge and must reach its socket directory
    for p in d.parents:   # munged: "execute permissions for all required" on the socket's path
        if p != Path("/") and os.stat(p).st_mode & 0o111 != 0o111:
            p.chmod(os.stat(p).st_mode | 0o111)
    (d / "state").mkdir()
    (d / "local").mkdir()
    state = {"nodes": {}, "munged": None, "slurmctld": None, "second": second_interface}
    try:
        write_config(d, n)
        state["munged"] = start_munge(d)
        save(d, state)
        sh("ip", "link", "add", BRIDGE, "type", "bridge")
        sh("ip", "addr", "add", f"{SUBNET}.1/24", "dev", BRIDGE)
        sh("ip", "link", "set", BRIDGE, "up")
        ctl = subprocess.Popen(["slurmctld", "-D", "-i", "-f", str(d / CONF)], stdout=open(d / "slurmctld.out", "a"),
                               stderr=subprocess.STDOUT, start_new_session=True)
        state["slurmctld"] = ctl.pid
        save(d, state)
        for i in range(1, n + 1):
            start_node(d, i, n, second_interface, state)
        wait_idle(d, list(state["nodes"]), timeout, ctl)
    except BaseException:
        down(d)
        raise
    return env(d)


def save(d: Path, state: dict) -> None:
    (d / "state.json").write_text(json.dumps(state))


def wait_idle(d: Path, names: list[str], timeout: float, ctl=None) -> None:
    deadline, states = time.time() + timeout, {}
    while time.time() < deadline:
        if ctl is not None and ctl.poll() is not None:
            raise RuntimeError(f"slurmctld exited: {(d / 'slurmctld.log').read_text().strip().splitlines()[-1]}")
        out = sh("sinfo", "-h", "-N", "-o", "%N %T", env=env(d), check=False).stdout.split("\n")
        states = dict(line.split() for line in out if line.strip())
        if all(states.get(name, "").rstrip("*") in ("idle", "mixed", "allocated") for name in names):
            return
        time.sleep(0.2)
    raise RuntimeError(f"nodes not idle after {timeout:.0f} s: {states}; see {d}/slurmctld.log")


def node_pids(holder: int) -> list[int]:
    """Every process in the node's network namespace except the holder."""
    try:
        ns = os.readlink(f"/proc/{holder}/ns/net")
    except OSError:
        return []
    pids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit() and int(p.name) != holder:
            try:
                if os.readlink(p / "ns/net") == ns:
                    pids.append(int(p.name))
            except OSError:
                pass
    return pids


def kill_node(d: Path, name: str) -> None:
    """Every process of the node (slurmd, the job's launcher and ranks) SIGKILLed: its sockets reset."""
    holder = json.loads((d / "state.json").read_text())["nodes"][name]
    for pid in node_pids(holder):
        with_pid(pid, signal.SIGKILL)


def silence_node(d: Path, name: str) -> None:
    """The node's link down inside its namespace: its processes live on, nothing is reset, nothing answers."""
    holder = json.loads((d / "state.json").read_text())["nodes"][name]
    sh("nsenter", "-t", holder, "--net", "ip", "link", "set", "eth0", "down")


def revive_node(d: Path, name: str) -> None:
    holder = json.loads((d / "state.json").read_text())["nodes"][name]
    sh("nsenter", "-t", holder, "--net", "ip", "link", "set", "eth0", "up")
    if not any("slurmd" in cmdline(pid) for pid in node_pids(holder)):
        start_slurmd(d, name, holder)
    sh("scontrol", "update", f"nodename={name}", "state=resume", env=env(d), check=False)
    wait_idle(d, [name], 30)


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def with_pid(pid: int, sig) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def stop(pids: list[int], timeout: float = 10) -> None:
    """TERM, then KILL what is left after timeout; each by its PID."""
    for pid in pids:
        with_pid(pid, signal.SIGTERM)
    deadline = time.time() + timeout
    while time.time() < deadline and any(Path(f"/proc/{p}").exists() and not zombie(p) for p in pids):
        time.sleep(0.1)
    for pid in pids:
        with_pid(pid, signal.SIGKILL)


def zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def down(d: Path) -> None:
    """Jobs cancelled (squeue empty), then every daemon stopped by its PID, the nodes' processes and
    namespaces, the links and the bridge removed. Safe to call twice or on a half-started cluster."""
    if not (d / "state.json").exists():
        return
    state = json.loads((d / "state.json").read_text())
    if state.get("slurmctld") and Path(f"/proc/{state['slurmctld']}").exists():
        sh("scancel", "--full", "-u", "root", env=env(d), check=False, timeout=20)
        deadline = time.time() + 30
        while time.time() < deadline and sh("squeue", "-h", env=env(d), check=False, timeout=20).stdout.strip():
            time.sleep(0.3)
    for holder in state["nodes"].values():   # slurmd and whatever a job left on the node, then the namespace holder
        stop(node_pids(holder), 5)
        stop([holder], 2)
    stop([state["slurmctld"]] if state.get("slurmctld") else [])
    stop([state["munged"]] if state.get("munged") else [])
    for i in range(1, len(state["nodes"]) + 2):
        sh("ip", "link", "del", f"{VETH}{i}h", check=False)
    sh("ip", "link", "del", BRIDGE, check=False)
    (d / "state.json").rename(d / "state.down.json")


def leftovers() -> list[str]:
    """What a cluster left on this machine: daemons started from a config of ours, namespace holders, links."""
    found = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit() and int(p.name) != os.getpid():
            line = cmdline(int(p.name))
            if MARK in line and not zombie(int(p.name)):
                found.append(f"process {p.name}: {line.strip()}")
    links = sh("ip", "-br", "link", check=False).stdout.split("\n")
    found += [f"link {line.split()[0]}" for line in links if line.startswith((BRIDGE, VETH))]
    return found


def main(argv: list[str]) -> int:
    import argparse
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["up", "down", "kill-node", "silence-node", "revive-node", "leftovers"])
    parser.add_argument("dir", nargs="?")
    parser.add_argument("node", nargs="?")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--second-interface", action="store_true")
    args = parser.parse_args(argv)
    if args.command == "leftovers":
        left = leftovers()
        print("\n".join(left) if left else "no SLURM cluster left: no daemon, namespace or link")
        return 1 if left else 0
    if not args.dir:
        parser.error(f"{args.command} needs the cluster's directory")
    d = Path(args.dir).resolve()
    if args.command == "up":
        try:
            up(d, args.nodes, args.second_interface)
        except RuntimeError as err:
            print(f"slurm_cluster: {err}", file=sys.stderr)
            return 1
        print(f"export SLURM_CONF={d}/{CONF}")
    elif args.command == "down":
        down(d)
    else:
        if not args.node:
            parser.error(f"{args.command} needs a node name (n1, n2, ...)")
        {"kill-node": kill_node, "silence-node": silence_node, "revive-node": revive_node}[args.command](d, args.node)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
