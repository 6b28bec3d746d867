"""An agent subprocess (`env.kwargs.command` with `sandboxed: true`) run in the local sandbox.

    exit_code, stdout, stderr = await run_sandboxed(config.sandbox, command, base_url, api_key, task, timeout_s)

The local sandbox (`envs/sandbox/local.py`: bubblewrap, or `unshare` namespaces) gives the agent
a network namespace of its own, with nothing in it: 127.0.0.1 there is not the roller's. So the
agent's endpoint is carried in over a Unix socket:

1. the roller listens on `<sandbox tmp>/agentrl-endpoint.sock` (the sandbox's `/tmp`) and
   forwards each connection to its endpoint on the host's 127.0.0.1 (`_bridge`);
2. inside, `FORWARDER` (Python's standard library only, run by the sandbox's `python3`) brings
   the loopback interface up, listens on 127.0.0.1 at the endpoint's port and forwards each
   connection to that socket, then runs the agent's command with the task on its stdin;
3. the agent gets the same `OPENAI_BASE_URL` as an unsandboxed one and reaches nothing else.

The agent's files, processes, uid and limits are the sandbox's (`sandbox.*`); its interpreter
and packages must be visible inside (`/usr`, or `sandbox.ro_paths`); `envs/agent.py` reads its
exit code and output as for any command agent. Only the local backend is supported: docker and
remote sandboxes have no host directory to carry a socket through.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from typing import Any
from urllib.parse import urlsplit

FORWARDER = r"""
import fcntl, socket, struct, subprocess, sys, threading
sock_path, port, task_path, cmd = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]
try:  # a fresh network namespace may have its loopback down (unshare; bwrap brings it up)
    s = socket.socket()
    flags = struct.unpack("16sH", fcntl.ioctl(s, 0x8913, struct.pack("16sH", b"lo", 0)))[1]
    fcntl.ioctl(s, 0x8914, struct.pack("16sH", b"lo", flags | 1))
except OSError:
    pass
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind(("127.0.0.1", port))
server.listen(1024)
def pipe(src, dst):
    try:
        while True:
            data = src.recv(1 << 16)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    finally:
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass
def serve():
    while True:
        conn, _ = server.accept()
        up = socket.socket(socket.AF_UNIX)
        try:
            up.connect(sock_path)
        except OSError:
            conn.close()
            continue
        threading.Thread(target=pipe, args=(conn, up), daemon=True).start()
        threading.Thread(target=pipe, args=(up, conn), daemon=True).start()
threading.Thread(target=serve, daemon=True).start()
with open(task_path, "rb") as f:
    task = f.read()
sys.stdout.flush()
sys.exit(subprocess.run(cmd, input=task).returncode)
"""


async def _bridge(port: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """One connection from inside the sandbox, forwarded to the endpoint on the host's loopback."""
    try:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        writer.close()
        return

    async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while data := await src.read(1 << 16):
                dst.write(data)
                await dst.drain()
            if dst.can_write_eof():
                dst.write_eof()
        except OSError:
            pass

    try:
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
    finally:
        for w in (writer, up_writer):
            w.close()


async def run_sandboxed(
    sandbox_config: Any, command: list[str], base_url: str, api_key: str, task: dict[str, Any], timeout: float
) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of the agent's command run in a fresh sandbox, closed after it
    (everything the agent left running is killed); `SandboxError` if the sandbox cannot start."""
    from agentrl.envs.sandbox import create

    port = urlsplit(base_url).port
    box = create(sandbox_config)
    await box.start()
    server = None
    try:
        host_tmp = box.root / "tmp"  # the local sandbox's /tmp, seen from the host
        sock = host_tmp / "agentrl-endpoint.sock"
        server = await asyncio.start_unix_server(lambda r, w: _bridge(port, r, w), path=str(sock))
        os.chmod(sock, 0o777)  # the sandbox's own uid connects to it
        await box.write_file(f"{box.tmpdir}/agentrl-forward.py", FORWARDER)
        await box.write_file(f"{box.tmpdir}/agentrl-task.json", json.dumps(task))
        inside = f"{box.tmpdir}/agentrl-endpoint.sock"
        argv = ["python3", f"{box.tmpdir}/agentrl-forward.py", inside, str(port),
                f"{box.tmpdir}/agentrl-task.json", *command]  # fmt: skip
        env = {"OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": api_key, "AGENTRL_TASK": json.dumps(task)}
        result = await box.exec(argv, timeout=timeout, env=env)
    finally:
        if server is not None:
            server.close()
            with contextlib.suppress(Exception):
                await server.wait_closed()
        await box.close()
    return result.exit_code, result.stdout, result.stderr
