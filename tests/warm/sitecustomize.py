"""The suite's warm start, the proxy half (tests/warm/server.py is the other). With `PYTHONPATH=tests/warm`
(tests/conftest.py sets it for every process the suite starts), a Python process that runs one of the
repository's scripts or a launcher (train.py, tools/*.py, accelerate, torchrun) asks the warm server,
before it imports anything, to fork a child that already holds torch, transformers, accelerate, datasets
and DeepSpeed. That child takes over this process's standard streams, working directory, environment
and command line and runs the script as `__main__`; this process stays as its stand-in: it forwards
every signal it can catch, and ends as the child ended (the same exit code, or killed by the same
signal). Everything else stays what a user's launch is: the real launcher, real rank processes, gloo.

It starts cold (a plain interpreter, as without this file) when the server is not up yet, when
BERT_RECIPES_WARM=0, for any interpreter flag but -u (-X importtime, -c, -m), and when the server's
imports could have read an environment variable that differs here (server.py decides and logs why).
Imports only the standard library's smallest modules: it runs in every Python process of the suite."""
import os
import sys


def _command() -> tuple[list[str], bool] | None:
    """(this interpreter's command line after its flags, whether -u was given), if it may start warm."""
    with open("/proc/self/cmdline", "rb") as f:
        argv = [a.decode() for a in f.read().split(b"\0")[:-1]]
    i = 1
    while i < len(argv) and argv[i] == "-u":
        i += 1
    if i >= len(argv) or argv[i].startswith("-"):
        return None          # -c, -m, -X ...: start cold
    return argv[i:], i > 1


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _proxy(socket_path: str, command: list[str], unbuffered: bool) -> None:
    import json
    import signal
    import socket
    try:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.settimeout(5)
        conn.connect(socket_path)
        request = json.dumps({"argv": command, "cwd": os.getcwd(), "env": dict(os.environ),
                              "unbuffered": unbuffered, "nice": os.nice(0), "umask": _umask()}).encode()
        socket.send_fds(conn, [len(request).to_bytes(8, "big") + request], [0, 1, 2])
        reader = conn.makefile("r")
        answer = reader.readline().split()
    except OSError:
        return               # no server (not up yet, or gone): cold
    if not answer or answer[0] != "pid":
        return               # the server said cold (its log says why)
    child = int(answer[1])
    conn.settimeout(None)

    def forward(signum, frame):
        try:
            os.kill(child, signum)
        except ProcessLookupError:
            pass
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
                signal.SIGCONT, signal.SIGWINCH):
        signal.signal(sig, forward)
    status = reader.readline().split()   # "exit N" or "signal N", when the child has ended
    sys.stdout.flush()
    if len(status) == 2 and status[0] == "signal":
        signum = int(status[1])
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    os._exit(int(status[1]) if len(status) == 2 and status[0] == "exit" else 1)


_socket = os.environ.get("BERT_RECIPES_WARM_SOCKET")
if _socket and os.environ.get("BERT_RECIPES_WARM", "1") != "0":
    _found = _command()
    if _found is not None:
        _proxy(_socket, *_found)
