"""The README's Ray cluster, formed with the README's own commands under token authentication:
the head's lines and the roller node's lines of its Scale-out block run as written (node address
`A` → 127.0.0.1, `TOKEN` → what the head printed), each node with its own home directory as on
two machines, in a loopback-only namespace. A node that joins without `RAY_AUTH_MODE=token` is
refused as the README says; with it, the cluster forms and `agentrl run --launcher ray` trains
the quickstart (two steps, tiny model) with the learner on the head and the roller on the other
node; at the end the launcher's state lists no process as running. Ray is stopped with `ray stop`
inside the private PID namespace (nothing else lives there), and the kernel ends what is left
when the namespace's first process exits."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from agentrl.launch.netns import netns_argv, netns_available
from agentrl.log import read_metrics
from tests.conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.integration]


def readme_ray_block() -> list[str]:
    """The command lines of the README's Scale-out (Ray) code block, comments dropped."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Scale-out (Ray)") :]
    block = section[section.index("```") + 3 :]
    block = block[block.index("\n") + 1 : block.index("```")]
    return [line.split("  #")[0].strip() for line in block.splitlines() if line and not line.startswith("#")]


def node_lines(lines: list[str]) -> tuple[list[str], list[str]]:
    """(the head's lines, the roller node's lines): each up to its `ray start`."""
    head_start = next(i for i, ln in enumerate(lines) if ln.startswith("ray start --head"))
    join = next(i for i, ln in enumerate(lines) if ln.startswith("ray start --address") and "sandbox" in ln)
    node_env = next(i for i, ln in enumerate(lines) if i > head_start and ln.startswith("export RAY_AUTH"))
    return lines[: head_start + 1], [lines[node_env], lines[join]]


@pytest.mark.timeout(600)
def test_the_readmes_ray_commands_form_a_token_authenticated_cluster_that_trains(
    tiny_model: Path, tmp_path: Path
) -> None:
    pytest.importorskip("ray", reason="ray is not installed (make setup installs the ray extra)")
    why = netns_available()
    if why:
        pytest.skip(f"Ray tests need a loopback-only network namespace: {why}")
    head, node = node_lines(readme_ray_block())
    assert any("RAY_AUTH_MODE=token" in ln for ln in head) and "RAY_AUTH_MODE=token" in node[0], (head, node)
    home_a, home_b, run_dir = tmp_path / "home_a", tmp_path / "home_b", tmp_path / "run"
    home_a.mkdir(), home_b.mkdir()
    bin_dir = Path(sys.executable).parent
    run = [
        sys.executable, "-m", "agentrl", "run", "--config", "recipes/quickstart.yaml", "--launcher", "ray",
        f"--run_dir={run_dir}", f"--learner.model_path={tiny_model}", "--learner.max_steps=2",
        "--learner.groups_per_step=2", "--learner.warmstart.steps=0", "--roller.group_size=4",
        "--roller.max_turns=2", "--learner.resources={learner: 1}", "--roller.resources={sandbox: 1}",
        "--launcher.address=127.0.0.1:6379",
    ]  # fmt: skip

    def on(node_home: Path, lines: list[str]) -> str:
        return f"export HOME={node_home}\n" + "\n".join(
            ln.replace("A:6379", "127.0.0.1:6379") for ln in lines
        )

    joined = re.sub(r"\bTOKEN\b", "$TOKEN", on(home_b, node))  # the token the head printed
    script = f"""set -u
export PATH={bin_dir}:$PATH RAY_USAGE_STATS_ENABLED=0 PYTHONPATH={REPO}:${{PYTHONPATH:-}}
cd {REPO}
( set -e
{on(home_a, head)}
) > {tmp_path}/head.out 2>&1 || {{ echo HEAD_FAILED; cat {tmp_path}/head.out; exit 1; }}
TOKEN=$(cat {home_a}/.ray/auth_token)
# a node that joins without token mode is refused (what the README warns about)
( export HOME={home_b}; {node[1].replace("A:6379", "127.0.0.1:6379")} ) > {tmp_path}/no_token.out 2>&1
echo "NO_TOKEN_RC=$?"
( set -e
{joined}
) > {tmp_path}/node.out 2>&1 || {{ echo NODE_FAILED; cat {tmp_path}/node.out; exit 1; }}
export HOME={home_a} RAY_AUTH_MODE=token
{shlex.join(run)} > {tmp_path}/run.out 2>&1
echo "RUN_RC=$?"
ray stop > /dev/null 2>&1
"""
    (tmp_path / "cluster.sh").write_text(script)
    result = subprocess.run(netns_argv(["bash", str(tmp_path / "cluster.sh")]), capture_output=True, text=True,
                            timeout=600, cwd=REPO)  # fmt: skip
    out = result.stdout
    run_out = (tmp_path / "run.out").read_text(errors="replace") if (tmp_path / "run.out").exists() else ""
    assert "RUN_RC=0" in out, out[-3000:] + result.stderr[-2000:] + run_out[-4000:]

    refused = (tmp_path / "no_token.out").read_text(errors="replace")
    assert re.search(r"NO_TOKEN_RC=[1-9]", out) and "InvalidAuthToken" in refused, refused[-2000:]
    assert (home_a / ".ray" / "auth_token").exists() and not (home_b / ".ray" / "auth_token").exists()

    assert [r["step"] for r in read_metrics(run_dir / "learner.jsonl")] == [1, 2]
    state = json.loads((run_dir / "launcher_state.json").read_text())
    nodes = {p["name"]: p.get("node_id") for p in state["processes"]}
    assert nodes["learner"] and nodes["roller0"] and nodes["learner"] != nodes["roller0"], state
    assert state["ended"] and not [p for p in state["processes"] if p["state"] == "running"], state
