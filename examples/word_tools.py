"""A tool environment in one short file: the README's example.

Run from the repository root (env modules are also looked up in the current directory):

    agentrl run --config recipes/word_tools.yaml        # warm start on demonstrate(), then RL
    agentrl roller --config recipes/word_tools.yaml --queue tcp://127.0.0.1:5555 --servers http://127.0.0.1:30000
"""

import json

from agentrl.envs import ToolEnv, tool

WORDS = ["banana", "committee", "mississippi", "bookkeeper", "assessment", "balloon", "referee", "tomorrow"]


class WordTools(ToolEnv):
    system_prompt = "Answer questions about words. Use the tools, then reply with the answer only."

    @tool
    def count_letters(self, word: str, letter: str) -> int:
        """Count how often a letter occurs in a word.

        Args:
            word: The word to look at.
            letter: A single letter.
        """
        return word.lower().count(letter.lower())

    @classmethod
    def generate_tasks(cls, num, seed=0):
        # `roller.tasks: builtin` calls this; "question" becomes the user turn, the rest is for reward()
        tasks = []
        for i in range(num):
            word = WORDS[(seed + i) % len(WORDS)]
            letter = word[(seed + i) // len(WORDS) % len(word)]  # a letter of the word
            tasks.append(
                {
                    "id": f"w{seed + i}",
                    "question": f"How many '{letter}' are in {word}?",
                    "word": word,
                    "letter": letter,
                    "answer": str(word.count(letter)),
                }
            )
        return tasks

    def reward(self, transcript):
        # a guess earns nothing: the answer counts only after a well-formed call of the tool
        called = transcript.metrics["tool_calls"] > transcript.metrics["tool_errors"]
        return float(called and transcript.final_text.strip() == self.task["answer"])

    def demonstrate(self, task):
        """The ideal conversation, for the supervised warm start (`learner.warmstart.steps`)."""
        arguments = {"word": task["word"], "letter": task["letter"]}
        call = json.dumps({"name": "count_letters", "arguments": arguments})
        return [
            *self.prompt(task),
            {"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
            {"role": "tool", "name": "count_letters", "content": task["answer"]},
            {"role": "assistant", "content": task["answer"]},
        ]
