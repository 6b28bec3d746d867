"""A scripted SGLang server that plays a hostile model, run in its own process.

    python -m tests.unit.rollers.hostile_server TOKENIZER_DIR PORT

The prompt's `case: NAME` picks the completion of the first turn (`COMPLETIONS`); once a tool
response is in the context the "model" answers `done`. Its own process, so that what the test
measures on the roller's event loop is the roller's work, not the server's JSON encoding.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys

from transformers import AutoTokenizer

from agentrl.bench.scripted_server import Reply, ScriptedServer

HUGE = "9" * 4300  # the largest int Python turns into text; the sum has one digit more


def _call(name: str, **arguments: object) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


COMPLETIONS = {
    "huge_int": f'<tool_call>{{"name": "add", "arguments": {{"a": {HUGE}, "b": {HUGE}}}}}</tool_call>',
    "huge_str": _call("echo", n=20_000_000),
    "nested": _call("nested", depth=200_000),
    "recursive": _call("recursive"),
    "many_calls": _call("add", a=1, b=2) * 1000,
    "five_mb": "<tool_call>" * 450_000,  # 4.95 MB of unclosed tags
}


def main(tokenizer_dir: str, port: int) -> None:
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    eos = tok.eos_token_id
    encoded = {name: [*tok.encode(text, add_special_tokens=False), eos] for name, text in COMPLETIONS.items()}
    done = [*tok.encode("done", add_special_tokens=False), eos]
    response_id = tok.convert_tokens_to_ids("<tool_response>")

    def script(ids: list[int], params: dict) -> Reply:
        if response_id in ids:  # a tool turn came back: the episode's second turn
            return Reply(done)
        case = re.search(r"case: (\w+)", tok.decode(ids)).group(1)
        return Reply(encoded[case])

    async def serve() -> None:
        server = ScriptedServer(script, record=False)
        print(await server.start(port), flush=True)
        await asyncio.Event().wait()

    asyncio.run(serve())


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
