"""The SWE agent's tools over a sandbox: `bash` and `str_replace_editor` (SWE-agent / OpenHands
semantics: view, create, str_replace, insert, undo_edit), with outputs truncated.

They act only through the `Sandbox` interface (exec, read_file, write_file), so they work the
same on the local, docker and remote backends. A misuse — old_str not found or not unique, a
bad line number, creating over an existing file — raises `EditorError` with the message the
model should see; the env turns it into an error observation.
"""

from __future__ import annotations

import shlex

from agentrl.envs.sandbox import Sandbox
from agentrl.envs.sandbox.base import truncate_output

SNIPPET_LINES = 4
MAX_EDIT_BYTES = 4 << 20


class EditorError(ValueError):
    """A tool call the model got wrong; its message is the observation."""


def numbered(text: str, start: int = 1) -> str:
    """`cat -n` style: right-aligned line numbers, a tab, the line."""
    return "".join(f"{n:6}\t{line}\n" for n, line in enumerate(text.split("\n"), start))


class SweTools:
    """`bash` and `str_replace_editor` for one episode's sandbox, with per-file undo history."""

    def __init__(
        self, sandbox: Sandbox, max_output_chars: int = 16000, bash_timeout_s: float = 120.0
    ) -> None:
        self.sandbox = sandbox
        self.max_output_chars = max_output_chars
        self.bash_timeout_s = bash_timeout_s
        self.history: dict[str, list[str]] = {}

    def _cut(self, text: str) -> str:
        data = text.encode()
        return truncate_output(data, self.max_output_chars) if len(data) > self.max_output_chars else text

    async def bash(self, command: str) -> str:
        """Run a shell command in the repository; the observation is its output and exit code."""
        result = await self.sandbox.exec(command, timeout=self.bash_timeout_s)
        out = result.stdout + (("\n" if result.stdout else "") + result.stderr if result.stderr else "")
        return self._cut(out) + f"\n[exit code {result.exit_code}]"  # a timeout is marked in stderr

    async def _read(self, path: str) -> str:
        try:
            data = await self.sandbox.read_file(path)
            if len(data) > MAX_EDIT_BYTES:
                raise EditorError(
                    f"{path} is {len(data)} bytes, too large to edit here; use bash (head, sed)."
                )
            return data.decode("utf-8", errors="replace")
        except FileNotFoundError:
            raise EditorError(f"The path {path} does not exist.") from None
        except IsADirectoryError:
            raise EditorError(f"The path {path} is a directory.") from None
        except PermissionError as exc:
            raise EditorError(f"The path {path} is outside the repository: {exc}") from None

    async def _is_dir(self, path: str) -> bool:
        return (await self.sandbox.exec(["test", "-d", path])).exit_code == 0

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
        """View, create and edit files: command is view | create | str_replace | insert | undo_edit."""
        if command == "view":
            return self._cut(await self._view(path, view_range))
        if command == "create":
            if file_text is None:
                raise EditorError("Parameter `file_text` is required for command: create.")
            if (await self.sandbox.exec(["test", "-e", path])).exit_code == 0:
                raise EditorError(
                    f"File already exists at: {path}. Cannot overwrite files using command `create`."
                )
            await self.sandbox.write_file(path, file_text)
            self.history.setdefault(path, [])
            return f"File created successfully at: {path}"
        if command == "str_replace":
            return await self._str_replace(path, old_str, new_str or "")
        if command == "insert":
            return await self._insert(path, insert_line, new_str)
        if command == "undo_edit":
            if not self.history.get(path):
                raise EditorError(f"No edit history found for {path}.")
            await self.sandbox.write_file(path, self.history[path].pop())
            return f"Last edit to {path} undone successfully."
        raise EditorError(
            f"Unknown command {command!r}; allowed: view, create, str_replace, insert, undo_edit."
        )

    async def _view(self, path: str, view_range: list[int] | None) -> str:
        if await self._is_dir(path):
            if view_range:
                raise EditorError(
                    "The `view_range` parameter is not allowed when `path` points to a directory."
                )
            listing = await self.sandbox.exec(
                f"find {shlex.quote(path)} -maxdepth 2 -not -path '*/.*' | sort", timeout=30
            )
            return f"Files and directories up to 2 levels deep in {path}, excluding hidden items:\n{listing.stdout}"
        text = await self._read(path)
        lines = text.split("\n")
        start, end = 1, len(lines)
        if view_range:
            if len(view_range) != 2 or not all(isinstance(n, int) for n in view_range):
                raise EditorError("`view_range` must be a list of two integers [start, end].")
            start, end = view_range[0], len(lines) if view_range[1] == -1 else view_range[1]
            if not 1 <= start <= len(lines) or end < start or end > len(lines):
                raise EditorError(f"Invalid `view_range` {view_range}: the file has {len(lines)} lines.")
        snippet = "\n".join(lines[start - 1 : end])
        return f"Here's the result of running `cat -n` on {path}:\n" + numbered(snippet, start)

    def _snippet(self, path: str, text: str, first_line: int, changed_lines: int) -> str:
        lines = text.split("\n")
        start = max(0, first_line - SNIPPET_LINES)
        end = min(len(lines), first_line + changed_lines + SNIPPET_LINES)
        body = numbered("\n".join(lines[start:end]), start + 1)
        return (
            f"The file {path} has been edited. Here's the result of running `cat -n` on a snippet of {path}:\n"
            f"{body}Review the changes and make sure they are as expected. Edit the file again if necessary."
        )

    async def _str_replace(self, path: str, old_str: str | None, new_str: str) -> str:
        if old_str is None or old_str == "":
            raise EditorError("Parameter `old_str` is required for command: str_replace.")
        text = await self._read(path)
        count = text.count(old_str)
        if count == 0:
            raise EditorError(
                f"No replacement was performed, old_str `{old_str}` did not appear verbatim in {path}."
            )
        if count > 1:
            lines = [n for n, line in enumerate(text.split("\n"), 1) if old_str.split("\n")[0] in line]
            raise EditorError(
                f"No replacement was performed. Multiple occurrences of old_str `{old_str}` in lines {lines}. "
                "Please ensure it is unique."
            )
        new_text = text.replace(old_str, new_str)
        await self.sandbox.write_file(path, new_text)
        self.history.setdefault(path, []).append(text)
        first = text.split(old_str)[0].count("\n")
        return self._cut(self._snippet(path, new_text, first, new_str.count("\n") + 1))

    async def _insert(self, path: str, insert_line: int | None, new_str: str | None) -> str:
        if new_str is None:
            raise EditorError("Parameter `new_str` is required for command: insert.")
        text = await self._read(path)
        lines = text.split("\n")
        if insert_line is None or not 0 <= insert_line <= len(lines):
            raise EditorError(
                f"Invalid `insert_line` parameter: {insert_line}. It should be within the range of lines "
                f"of the file: [0, {len(lines)}]"
            )
        new_text = "\n".join(lines[:insert_line] + new_str.split("\n") + lines[insert_line:])
        await self.sandbox.write_file(path, new_text)
        self.history.setdefault(path, []).append(text)
        return self._cut(self._snippet(path, new_text, insert_line, new_str.count("\n") + 1))
