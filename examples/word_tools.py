"""A tool environment in one short file: the README's example.

    agentrl roller --config recipes/quickstart.yaml --env.name examples.word_tools:WordTools \
        --queue tcp://127.0.0.1:5555 --servers http://127.0.0.1:30000
"""

from agentrl.envs import ToolEnv, tool


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
        words = ["banana", "committee", "mississippi", "bookkeeper", "assessment"]
        return [
            {
                "id": f"w{i}",
                "question": f"How many 's' are in {words[(seed + i) % 5]}?",
                "answer": str(words[(seed + i) % 5].count("s")),
            }
            for i in range(num)
        ]

    def reward(self, transcript):
        return float(transcript.final_text.strip() == self.task["answer"])
