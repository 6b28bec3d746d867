"""A newcomer's two-tool env (unit conversions) whose prompt, with its system prompt and two tool
schemas, exceeds the quickstart's budget (`roller.max_total_tokens: 256`): the env check's tests
import it, and the command-line test copies it into a directory of its own as `unit_env.py`."""

import json

from agentrl.envs import ToolEnv, tool

FACTORS = {("km", "m"): 1000, ("m", "cm"): 100, ("kg", "g"): 1000, ("h", "min"): 60}


class UnitConverter(ToolEnv):
    system_prompt = (
        "You convert quantities between units. First look up the conversion factor with the "
        "factor tool, then multiply with the multiply tool, then reply with the number only."
    )

    @tool
    def factor(self, source: str, target: str) -> int:
        """Look up how many target units make one source unit.

        Args:
            source: The unit converted from, e.g. "km".
            target: The unit converted to, e.g. "m".
        """
        return FACTORS[(source, target)]

    @tool
    def multiply(self, a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: The first factor.
            b: The second factor.
        """
        return a * b

    @classmethod
    def generate_tasks(cls, num, seed=0):
        pairs = sorted(FACTORS)
        tasks = []
        for i in range(num):
            source, target = pairs[(seed + i) % len(pairs)]
            amount = 2 + (seed + i) % 7
            tasks.append(
                {
                    "id": f"u{i}",
                    "question": f"How many {target} are {amount} {source}?",
                    "source": source,
                    "target": target,
                    "amount": amount,
                    "answer": str(amount * FACTORS[(source, target)]),
                }
            )
        return tasks

    def reward(self, transcript):
        return float(transcript.final_text.strip() == self.task["answer"])

    def demonstrate(self, task):
        f = FACTORS[(task["source"], task["target"])]
        call1 = json.dumps(
            {"name": "factor", "arguments": {"source": task["source"], "target": task["target"]}}
        )
        call2 = json.dumps({"name": "multiply", "arguments": {"a": task["amount"], "b": f}})
        return [
            *self.prompt(task),
            {"role": "assistant", "content": f"<tool_call>\n{call1}\n</tool_call>"},
            {"role": "tool", "name": "factor", "content": str(f)},
            {"role": "assistant", "content": f"<tool_call>\n{call2}\n</tool_call>"},
            {"role": "tool", "name": "multiply", "content": task["answer"]},
            {"role": "assistant", "content": task["answer"]},
        ]
