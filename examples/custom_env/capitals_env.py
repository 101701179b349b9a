"""capitals_env.py: a country -> capital quiz with an atlas tool and a simulated user."""

from agentrl.envs.base import Env
from agentrl.envs.rewards import exact_match, final_assistant_text
from agentrl.envs.sources import TaskSource
from agentrl.tools.base import ToolError, tool


class CapitalsEnv(Env):
    name = "capitals"

    def __init__(self, path: str, test_path: str = ""):
        # One file per split; this toy reuses the training file when no test file is given.
        self.source = TaskSource(train=path, test=test_path or path)
        capitals = {r["country"].lower(): r["capital"] for r in self.source.records("train")}

        @tool
        def atlas(country: str) -> str:
            """Look up the capital of a country.

            Args:
                country: the country's name in English.
            """
            capital = capitals.get(country.strip().lower())
            if capital is None:
                raise ToolError(f"no country named {country!r}")  # the model reads it as an error
            return f"The capital of {country} is {capital}."

        self._tools = [atlas]

    def tasks(self, split="train", seed=0):
        return self.source.tasks(split, seed)  # "train" cycles forever, reshuffled per pass

    def initial_messages(self, task):
        return [
            {"role": "system", "content": "Answer with 'Answer: <city>'."},
            {"role": "user", "content": f"What is the capital of {task.data['country']}?"},
        ]

    def tools(self):
        return self._tools

    async def setup(self, task):
        return {"nudged": False}  # per-episode state, passed to every other method

    async def on_text_turn(self, task, state, messages):
        if "Answer:" in messages[-1]["content"] or state["nudged"]:
            return None  # end the episode
        state["nudged"] = True
        return "Please reply in the form 'Answer: <city>'."  # the simulated user speaks

    async def reward(self, task, state, messages):
        text = final_assistant_text(messages) or ""  # None if the episode ended on a tool call
        return {"correct": float(exact_match(text.split("Answer:")[-1], task.data["capital"]))}

    def demonstration(self, task):
        country, capital = task.data["country"], task.data["capital"]
        call = {"type": "function", "function": {"name": "atlas", "arguments": {"country": country}}}
        return [
            *self.initial_messages(task),
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "atlas", "content": f"The capital of {country} is {capital}."},
            {"role": "assistant", "content": f"Answer: {capital}"},
        ]
