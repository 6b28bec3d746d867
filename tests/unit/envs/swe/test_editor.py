"""The SWE tools on a real local sandbox: the editor's commands, its errors, and bash."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from agentrl.envs.sandbox import create
from agentrl.envs.swe.editor import EditorError, SweTools
from tests.unit.envs.swe.test_swe_tasks import SANDBOX


@pytest.fixture
async def tools() -> AsyncIterator[SweTools]:
    box = create(SANDBOX)
    await box.start()
    await box.write_file("pkg/mod.py", "def f():\n    return 1\n\n\ndef g():\n    return 1\n")
    yield SweTools(box, max_output_chars=2000, bash_timeout_s=2)
    await box.close()


async def test_view_file_range_and_directory(tools: SweTools) -> None:
    out = await tools.str_replace_editor("view", "pkg/mod.py")
    assert "     1\tdef f():\n     2\t    return 1\n" in out
    assert (await tools.str_replace_editor("view", "pkg/mod.py", view_range=[5, -1])).endswith(
        "     5\tdef g():\n     6\t    return 1\n     7\t\n"
    )
    listing = await tools.str_replace_editor("view", ".")
    assert "./pkg/mod.py" in listing
    with pytest.raises(EditorError, match="view_range"):
        await tools.str_replace_editor("view", "pkg/mod.py", view_range=[9, 12])
    with pytest.raises(EditorError, match="does not exist"):
        await tools.str_replace_editor("view", "pkg/nope.py")


async def test_str_replace_requires_a_unique_match_and_undo_restores(tools: SweTools) -> None:
    with pytest.raises(EditorError, match=r"Multiple occurrences .* lines \[2, 6\]"):
        await tools.str_replace_editor("str_replace", "pkg/mod.py", old_str="return 1", new_str="return 2")
    with pytest.raises(EditorError, match="did not appear verbatim"):
        await tools.str_replace_editor("str_replace", "pkg/mod.py", old_str="return 3", new_str="x")
    out = await tools.str_replace_editor(
        "str_replace", "pkg/mod.py", old_str="def g():\n    return 1", new_str="def g():\n    return 2"
    )
    assert "has been edited" in out and "     6\t    return 2" in out
    assert (await tools.sandbox.read_file("pkg/mod.py")).decode().endswith("def g():\n    return 2\n")
    await tools.str_replace_editor("insert", "pkg/mod.py", insert_line=0, new_str="import os")
    assert (await tools.sandbox.read_file("pkg/mod.py")).decode().startswith("import os\ndef f():")
    await tools.str_replace_editor("undo_edit", "pkg/mod.py")
    await tools.str_replace_editor("undo_edit", "pkg/mod.py")
    assert (await tools.sandbox.read_file("pkg/mod.py")).decode().endswith("def g():\n    return 1\n")
    with pytest.raises(EditorError, match="No edit history"):
        await tools.str_replace_editor("undo_edit", "pkg/mod.py")
    with pytest.raises(EditorError, match="insert_line"):
        await tools.str_replace_editor("insert", "pkg/mod.py", insert_line=99, new_str="x")


async def test_create_never_overwrites_and_paths_stay_inside(tools: SweTools) -> None:
    assert "created" in await tools.str_replace_editor("create", "new/a.py", file_text="A = 1\n")
    with pytest.raises(EditorError, match="already exists"):
        await tools.str_replace_editor("create", "new/a.py", file_text="B = 2\n")
    with pytest.raises(EditorError, match="outside"):
        await tools.str_replace_editor("view", "/etc/hostname")
    with pytest.raises(EditorError, match="Unknown command"):
        await tools.str_replace_editor("delete", "new/a.py")


async def test_bash_reports_exit_code_timeouts_and_truncates(tools: SweTools) -> None:
    assert await tools.bash("python3 -c 'import pkg.mod as m; print(m.f())'") == "1\n\n[exit code 0]"
    assert (await tools.bash("echo oops >&2; exit 3")).endswith("oops\n\n[exit code 3]")
    slow = await tools.bash("sleep 30")
    assert "timed out after 2s" in slow
    flood = await tools.bash("yes | head -c 100000")
    assert "truncated" in flood and len(flood) < 2200
