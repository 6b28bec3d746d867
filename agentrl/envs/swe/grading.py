"""Grade a SWE task by running its tests in a sandbox: reward 1 iff every FAIL_TO_PASS test
passes and every PASS_TO_PASS test still passes, else 0.

Grading follows the SWE-bench harness: take the model's change as a patch (`git diff` of
the working tree it edited), apply it to a *fresh* sandbox of the task's repository, apply
the hidden `test_patch`, run the listed tests. A fresh sandbox means nothing the model left
running or planted outside its diff takes part.

Test outcomes come from a small pytest plugin written into the sandbox under a random
name: it records each test id's outcome (setup, call and teardown must all pass) to a
JSON file whose path the code under test is not told, rather than from parsing console
output the code under test could print into.
"""

from __future__ import annotations

import json
import secrets
import shlex
from dataclasses import dataclass, field
from typing import Any

from agentrl.envs.sandbox import Sandbox, create
from agentrl.envs.swe.tasks import SweTask

GIT = "git -c user.email=agent@agentrl.local -c user.name=agent -c commit.gpgsign=false"
PLUGIN = """
import json, os
_good, _bad = set(), set()
def pytest_runtest_logreport(report):
    xfail = report.skipped and hasattr(report, "wasxfail")
    if report.failed or (report.skipped and not xfail):
        _bad.add(report.nodeid)
    elif report.when == "call":
        _good.add(report.nodeid)
def pytest_sessionfinish(session, exitstatus):
    with open(os.environ["AGENTRL_GRADE_OUT"], "w") as f:
        json.dump({n: n in _good and n not in _bad for n in _good | _bad}, f)
"""


@dataclass
class Grade:
    """The outcome of grading one task."""

    reward: float
    fail_to_pass: dict[str, bool] = field(default_factory=dict)
    pass_to_pass: dict[str, bool] = field(default_factory=dict)
    patch_applied: bool = True
    timed_out: bool = False
    log: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


async def prepare_repo(sandbox: Sandbox) -> None:
    """Make the sandbox's working tree a git repository with one commit, so the model's
    change can later be read back as a diff (no-op when it already is one)."""
    cmd = f"git rev-parse --git-dir >/dev/null 2>&1 || ({GIT} init -q . && git add -A && {GIT} commit -q -m base)"
    result = await sandbox.exec(cmd, timeout=120)
    if result.exit_code != 0:
        raise RuntimeError(f"cannot initialise git in the sandbox: {result.stderr.strip()}")


async def extract_patch(sandbox: Sandbox) -> str:
    """The model's change to the repository as a unified diff (new files included)."""
    result = await sandbox.exec(f"git add -A >/dev/null && {GIT} diff --cached --binary HEAD", timeout=120)
    return result.stdout if result.exit_code == 0 else ""


async def apply_patch(sandbox: Sandbox, patch: str) -> tuple[bool, str]:
    """Apply a unified diff in the working directory (git apply, falling back to patch -p1)."""
    if not patch.strip():
        return True, ""
    name = f"{sandbox.tmpdir}/agentrl-{secrets.token_hex(6)}.diff"
    await sandbox.write_file(name, patch if patch.endswith("\n") else patch + "\n")
    result = await sandbox.exec(
        f"git apply --whitespace=nowarn {name} || patch -p1 --batch < {name}", timeout=120
    )
    await sandbox.exec(f"rm -f {name}")
    return result.exit_code == 0, result.stdout + result.stderr


async def run_tests(
    sandbox: Sandbox, task: SweTask, tests: list[str], timeout: float
) -> tuple[dict[str, bool], str, bool]:
    """Run `tests` with the task's test command; each id maps to whether it passed (a test
    that did not run — not collected, crashed, timed out — counts as failed)."""
    token = secrets.token_hex(8)
    plugin_dir, out = (
        f"{sandbox.tmpdir}/agentrl-grader-{token}",
        f"{sandbox.tmpdir}/agentrl-grade-{token}.json",
    )
    await sandbox.write_file(f"{plugin_dir}/agentrl_grader_{token}.py", PLUGIN)
    env = {"PYTHONPATH": plugin_dir, "AGENTRL_GRADE_OUT": out, "PYTHONDONTWRITEBYTECODE": "1"}
    ids = " ".join(shlex.quote(t) for t in tests)
    result = await sandbox.exec(f"{task.test_cmd} -p agentrl_grader_{token} {ids}", timeout=timeout, env=env)
    try:
        outcomes = json.loads(await sandbox.read_file(out))
    except (FileNotFoundError, ValueError):
        outcomes = {}
    await sandbox.exec(f"rm -rf {plugin_dir} {out}")
    passed = {t: bool(outcomes.get(t, False)) for t in tests}
    return passed, result.stdout[-4000:] + result.stderr[-4000:], result.timed_out


async def grade(sandbox: Sandbox, task: SweTask, timeout: float = 300.0) -> Grade:
    """Apply the hidden test patch in `sandbox` (already holding the candidate change), run
    FAIL_TO_PASS and PASS_TO_PASS, and score."""
    ok, log = await apply_patch(sandbox, task.test_patch)
    if not ok:
        return Grade(0.0, patch_applied=False, log="test_patch does not apply:\n" + log)
    outcomes, log, timed_out = await run_tests(sandbox, task, task.FAIL_TO_PASS + task.PASS_TO_PASS, timeout)
    f2p = {t: outcomes[t] for t in task.FAIL_TO_PASS}
    p2p = {t: outcomes[t] for t in task.PASS_TO_PASS}
    reward = float(all(f2p.values()) and all(p2p.values()))
    return Grade(reward, f2p, p2p, timed_out=timed_out, log=log)


async def grade_patch(sandbox_config: Any, task: SweTask, patch: str, timeout: float = 300.0) -> Grade:
    """Grade `patch` the SWE-bench way: a fresh sandbox of the task, the patch, the hidden tests."""
    if sandbox_config.type == "docker":  # the repository is where the task's image put it
        sandbox_config = sandbox_config.model_copy(update={"workdir": task.workdir})
    sandbox = create(sandbox_config)
    # a local sandbox copies the snapshot; docker and remote ones start the task's image when it
    # has one, else the default image with the snapshot copied in
    await sandbox.start(task.repo_dir if sandbox_config.type == "local" else task.image or task.repo_dir)
    try:
        ok, log = await apply_patch(sandbox, patch)
        if not ok:
            return Grade(0.0, patch_applied=False, log="patch does not apply:\n" + log)
        return await grade(sandbox, task, timeout)
    finally:
        await sandbox.close()
