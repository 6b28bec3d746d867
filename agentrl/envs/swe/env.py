"""The SWE environment: fix an issue in a repository inside a sandbox; reward = the tests pass.

    env:
      name: swe
      sandbox: {type: local, python_packages: [pytest], memory_mb: 1024, timeout_s: 60}
      kwargs: {max_steps: 30}

One sandbox per episode, started from the task (its Docker image, or a copy of its repository
snapshot) and made a git repository so the model's change can be read back as a diff. The
model has three tools: `bash` (a shell in the repository), `str_replace_editor` (view,
create, str_replace, insert, undo_edit) and `submit` (ends the episode). Model-written
commands run only inside the sandbox: a command that hangs, floods output or exhausts its
limits comes back as an observation and the episode goes on.

The reward follows the SWE-bench harness (`grading.grade_patch`): the episode sandbox's
`git diff` is applied to a *fresh* sandbox of the task, the hidden tests are added, and the
reward is 1 iff every FAIL_TO_PASS test passes and every PASS_TO_PASS test still passes.
Metrics record steps, tool errors, whether the model submitted, the test counts, and
`hit_limit` when the episode ended by a limit rather than by the model (DeepSWE's
"compact filtering": training can drop those episodes instead of punishing them).
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

import pydantic

from agentrl.envs.base import Messages, StepResult, Transcript
from agentrl.envs.sandbox import Sandbox, create
from agentrl.envs.sandbox.config import LocalSandboxConfig, SandboxConfig
from agentrl.envs.swe.editor import SweTools, numbered
from agentrl.envs.swe.grading import extract_patch, grade_patch, prepare_repo
from agentrl.envs.swe.synthetic import generate
from agentrl.envs.swe.tasks import SweTask, load_tasks
from agentrl.envs.tool_env import ToolEnv
from agentrl.envs.tools import tool, truncate
from agentrl.log import get_logger

logger = get_logger("envs.swe")

SYSTEM_PROMPT = (
    "You are a software engineer fixing an issue in a Python repository. Explore the code with the "
    "`bash` and `str_replace_editor` tools, make the smallest change that fixes the issue, check it, "
    "then call `submit`. Do not edit or add tests: hidden tests decide whether the issue is fixed."
)
PROMPT = """<issue>
{problem_statement}
</issue>

The repository is checked out at {workdir} (your working directory). Paths may be relative to it.
Tools: `bash` runs a shell command there (no network; long commands time out); `str_replace_editor`
views (`view`) and edits files (`str_replace`, `insert`, `create`, `undo_edit`). Run the visible tests
with `{test_cmd}`. When the fix is in place, call `submit`."""


def _call(name: str, arguments: dict[str, Any]) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def parse_patch(patch: str) -> list[tuple[str, str, str, bool]]:
    """(path, old_str, new_str, new_file) per hunk of a unified diff: old_str is the hunk's
    context and removed lines, new_str its context and added lines."""
    hunks: list[tuple[str, str, str, bool]] = []
    path, new_file, old, new = "", False, None, None

    def flush() -> None:
        if old is not None and new is not None:
            hunks.append((path, "\n".join(old), "\n".join(new), new_file))

    for line in patch.splitlines():
        if line.startswith("--- "):
            flush()
            old = new = None
            new_file = line[4:].split("\t")[0].strip() == "/dev/null"
        elif line.startswith("+++ "):
            target = line[4:].split("\t")[0].strip()
            path = target[2:] if target.startswith("b/") else target
        elif line.startswith("@@"):
            flush()
            old, new = [], []
        elif old is not None and new is not None and line[:1] in (" ", "-", "+", ""):
            if line[:1] != "+":
                old.append(line[1:])
            if line[:1] != "-":
                new.append(line[1:])
    flush()
    return hunks


class SWEEnv(ToolEnv):
    """Fix a repository's issue with bash and an editor in a sandbox; reward 1 iff its tests pass."""

    system_prompt = SYSTEM_PROMPT
    required_task_fields = ("instance_id", "problem_statement", "FAIL_TO_PASS", ("repo_dir", "image"))

    def __init__(
        self,
        sandbox: SandboxConfig | dict[str, Any] | None = None,
        max_steps: int | None = None,
        grade_timeout_s: float = 300.0,
        command_timeout_s: float | None = None,
        repo_root: str | None = None,
        **kwargs: Any,
    ) -> None:
        """
        Args:
            sandbox: where episodes run (`config.env.sandbox`, passed by env_factory); a dict is
                validated as a sandbox section; default: a local sandbox.
            max_steps: tool turns after which the env ends the episode (flagged `hit_limit`);
                None leaves it to roller.max_turns.
            grade_timeout_s: time the hidden tests may take when grading.
            command_timeout_s: time one `bash` command may take; default: 80% of the tool timeout,
                capped by the sandbox's `timeout_s` (so the sandbox kills the command first).
            repo_root: directory relative `repo_dir`s of tasks are resolved against (default: cwd).
        """
        super().__init__(**kwargs)
        if sandbox is None:
            sandbox = LocalSandboxConfig()
        elif isinstance(sandbox, dict):
            sandbox = pydantic.TypeAdapter(SandboxConfig).validate_python({"type": "local", **sandbox})
        self.sandbox_config = sandbox
        self.max_steps = max_steps
        self.grade_timeout_s = grade_timeout_s
        limit = self.tool_timeout_s * 0.8
        if getattr(sandbox, "timeout_s", None):
            limit = min(limit, sandbox.timeout_s)
        self.command_timeout_s = command_timeout_s or max(1.0, limit)
        self.repo_root = Path(repo_root) if repo_root else None
        self.sandbox: Sandbox | None = None
        self.swe: SweTools | None = None
        self.swe_task: SweTask | None = None
        self.submitted = False
        self.metrics.update({"steps": 0, "submitted": 0})

    # ------------------------------------------------------------------ episode

    def _task(self, task: dict[str, Any]) -> SweTask:
        swe = SweTask.from_dict(task, base_dir=self.repo_root or Path.cwd())
        if swe.repo_dir is None and swe.image is None:
            raise ValueError(f"SWE task {swe.instance_id}: needs `repo_dir` (a snapshot) or `image`")
        return swe

    async def reset(self, task: dict[str, Any]) -> Messages:
        """Start the episode's sandbox from the task and return the prompt."""
        self.task = task
        self.swe_task = swe = self._task(task)
        config = self.sandbox_config
        if config.type == "docker":  # the repository is where the task's image put it
            config = config.model_copy(update={"workdir": swe.workdir})
        self.sandbox = create(config)
        await self.sandbox.start(swe.repo_dir if config.type == "local" else swe.image or swe.repo_dir)
        await prepare_repo(self.sandbox)
        self.swe = SweTools(self.sandbox, self._output_budget(), self.command_timeout_s)
        self.metrics["isolation"] = self.sandbox.isolation
        return self.prompt(task)

    def prompt(self, task: dict[str, Any]) -> Messages:
        swe = self.swe_task or self._task(task)
        workdir = (
            self.sandbox.workdir
            if self.sandbox is not None
            else getattr(self.sandbox_config, "workdir", "/work")
        )
        text = PROMPT.format(
            problem_statement=swe.problem_statement.strip(), workdir=workdir, test_cmd=swe.test_cmd
        )
        return [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": text}]

    async def step(self, action_text: str) -> StepResult:
        if self.sandbox is None:
            raise RuntimeError("SWEEnv.step before reset")
        self.metrics["steps"] += 1
        result = await super().step(action_text)
        if self.submitted:
            return StepResult(None, 0.0, True, {**(result.info or {}), "submitted": True})
        if not result.done and self.max_steps is not None and self.metrics["steps"] >= self.max_steps:
            self.metrics["step_limit"] = 1
            return StepResult(None, 0.0, True, {**(result.info or {}), "step_limit": True})
        return result

    # ------------------------------------------------------------------ tools

    @tool
    async def bash(self, command: str) -> str:
        """Run a shell command in the repository (no network; long-running commands are killed).

        Args:
            command: The command, e.g. "grep -rn 'def mean' ." or "python3 -m pytest -q".
        """
        return await self._tools().bash(command)

    @tool
    async def str_replace_editor(
        self,
        command: str,
        path: str,
        file_text: str | None = None,
        old_str: str | None = None,
        new_str: str | None = None,
        insert_line: int | None = None,
        view_range: list[int] | None = None,
    ) -> str:
        """View, create and edit files.

        Args:
            command: One of view, create, str_replace, insert, undo_edit.
            path: File or directory, relative to the repository or absolute.
            file_text: Content of the new file (create).
            old_str: Exact text to replace; must occur exactly once (str_replace).
            new_str: Replacement text (str_replace) or text to insert (insert).
            insert_line: Insert new_str after this line number; 0 inserts at the top (insert).
            view_range: [start, end] lines to show, end -1 for the end of the file (view).
        """
        return await self._tools().str_replace_editor(
            command, path, file_text, old_str, new_str, insert_line, view_range
        )

    @tool
    def submit(self) -> str:
        """Submit the current state of the repository as the fix; ends the episode."""
        self.submitted = True
        self.metrics["submitted"] = 1
        return "Submitted."

    def _output_budget(self) -> int:
        """SweTools keeps head and tail within this, leaving room for its markers and the exit code
        under the env's own cut (which keeps only the head)."""
        return max(32, self.max_tool_output_chars - 128)

    def _tools(self) -> SweTools:
        if self.swe is None:
            raise RuntimeError("the sandbox is not started")
        return self.swe

    # ------------------------------------------------------------------ reward and clean-up

    async def reward(self, transcript: Transcript) -> float:
        """Grade the diff of the episode's repository in a fresh sandbox: 1 iff the tests pass."""
        self.metrics["hit_limit"] = int(transcript.finish_reason != "done" or "step_limit" in self.metrics)
        if self.sandbox is None or self.swe_task is None:
            return 0.0
        patch = await extract_patch(self.sandbox)
        await self._close()  # free the episode's sandbox before starting the grader's
        self.metrics["patch_lines"] = sum(
            1
            for line in patch.splitlines()
            if line.startswith(("+", "-")) and not line.startswith(("+++", "---"))
        )
        if not patch.strip():
            self.metrics.update(tests_passed=0, tests_failed=len(self.swe_task.FAIL_TO_PASS), resolved=0)
            return 0.0
        t0 = time.perf_counter()
        grade = await grade_patch(self.sandbox_config, self.swe_task, patch, self.grade_timeout_s)
        outcomes = [*grade.fail_to_pass.values(), *grade.pass_to_pass.values()]
        self.metrics.update(
            grade_s=round(time.perf_counter() - t0, 3),
            patch_applied=int(grade.patch_applied),
            f2p_passed=sum(grade.fail_to_pass.values()),
            p2p_passed=sum(grade.pass_to_pass.values()),
            tests_passed=sum(outcomes),
            tests_failed=len(outcomes) - sum(outcomes) if outcomes else len(self.swe_task.FAIL_TO_PASS),
            grade_timed_out=int(grade.timed_out),
            resolved=int(grade.reward == 1.0),
        )
        return grade.reward

    def close(self) -> Any:
        """Close the sandbox (a coroutine when there is one to close; safe to call twice)."""
        return self._close() if self.sandbox is not None else None

    async def _close(self) -> None:
        sandbox, self.sandbox = self.sandbox, None
        if sandbox is not None:
            await sandbox.close()

    # ------------------------------------------------------------------ tasks and demonstrations

    @classmethod
    def generate_tasks(
        cls, num: int, seed: int = 0, out_dir: str | None = None, **kwargs: Any
    ) -> list[dict[str, Any]]:
        """`num` synthetic planted-bug tasks, their repositories written under `out_dir` (default:
        the temp dir); the same (num, seed) reuses what an earlier call wrote."""
        if kwargs:
            raise TypeError(f"SWEEnv.generate_tasks: unknown options {sorted(kwargs)}")
        base = Path(out_dir or Path(tempfile.gettempdir()) / "agentrl-swe-tasks")
        target = base / f"seed{seed}-n{num}"
        if not (target / "tasks.jsonl").exists():
            base.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=base))
            generate(staging, num, seed)
            try:
                staging.rename(target)  # atomic: concurrent callers see all of it or none
            except OSError:  # another process got there first
                import shutil

                shutil.rmtree(staging, ignore_errors=True)
        return [t.to_dict() for t in load_tasks(target / "tasks.jsonl")]

    def demonstrate(self, task: dict[str, Any]) -> Messages:
        """The ideal episode for a task with a snapshot and a gold patch: view the file, apply the
        fix with str_replace_editor, submit (observations as the tools would produce them)."""
        swe = self._task(task)
        if swe.repo_dir is None or not swe.patch:
            raise ValueError(f"SWE task {swe.instance_id}: demonstrations need `repo_dir` and `patch`")
        editor = SweTools(None, self._output_budget())  # type: ignore[arg-type]  # formatting only
        messages = self.prompt(task)
        files: dict[str, str] = {}

        def turn(name: str, arguments: dict[str, Any], output: str) -> None:
            text, _ = truncate(editor._cut(output), self.max_tool_output_chars)
            messages.append({"role": "assistant", "content": _call(name, arguments)})
            messages.append({"role": "tool", "name": name, "content": text})

        for path, old, new, new_file in parse_patch(swe.patch):
            if new_file:
                turn("str_replace_editor", {"command": "create", "path": path, "file_text": new + "\n"},
                     f"File created successfully at: {path}")  # fmt: skip
                continue
            if path not in files:
                files[path] = (Path(swe.repo_dir) / path).read_text()
                view = f"Here's the result of running `cat -n` on {path}:\n" + numbered(files[path])
                turn("str_replace_editor", {"command": "view", "path": path}, view)
            text = files[path]
            if text.count(old) != 1:
                raise ValueError(f"SWE task {swe.instance_id}: gold hunk is not unique in {path}")
            files[path] = text.replace(old, new)
            first = text.split(old)[0].count("\n")
            arguments = {"command": "str_replace", "path": path, "old_str": old, "new_str": new}
            turn(
                "str_replace_editor",
                arguments,
                editor._snippet(path, files[path], first, new.count("\n") + 1),
            )
        messages.append({"role": "assistant", "content": _call("submit", {})})
        return messages
