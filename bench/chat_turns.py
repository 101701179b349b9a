"""Per-turn CPU cost of the token-in/token-out bookkeeping (:class:`agentrl.episode.chat.TokenChat`).

Scripted episodes shaped like the calculator quickstart (tool call and result per turn, then the
answer); CPU time per model turn of ``append_model`` + ``close_turn_and_add``. Side by side, a
reference that takes the non-model text as the delta between two renderings of the whole chat
(prefix-stable templates only: the tiny model's, Qwen2.5, Llama 3.1); Qwen3 runs with thinking
turns. See docs/performance.md.

    python bench/chat_turns.py --episodes 300 --turns 1 3 8
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SMOKE = {"episodes": 4, "rounds": 1, "turns": [1], "families": ["tiny", "qwen3"]}
SMOKE_HELP = "the same code path on the smallest sizes, in seconds: checks the path, not the numbers"

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
START = [
    {"role": "system", "content": "Solve the problem. Use the calculator."},
    {"role": "user", "content": "Tom has 12 apples and buys 30 more. How many apples does he have?"},
]


def turns(family: str, n: int) -> list[tuple[str, list[dict]]]:
    """(model text, observations) per turn; the last turn is the answer (no observations)."""
    think = "<think>\nAdd the numbers with the tool.\n</think>\n\n" if family.startswith("qwen3") else ""
    if family.startswith("llama"):
        call = json.dumps({"name": "calculator", "parameters": {"expression": "12 + 30"}})
    else:
        body = json.dumps({"name": "calculator", "arguments": {"expression": "12 + 30"}})
        call = f"<tool_call>\n{body}\n</tool_call>"
    out = [(think + call, [{"role": "tool", "name": "calculator", "content": "42"}]) for _ in range(n)]
    return out + [(think + "The answer is 42.", [])]


def tokenizer_for(family: str, model: str = ""):
    if family == "tiny" and model:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model)
    if family == "tiny":
        from agentrl.models.builder import SIZES, build_tokenizer

        return build_tokenizer(SIZES["tiny"]["vocab_target"], seed=0)
    from tests._chat_templates import family_tokenizer

    return family_tokenizer(family)


def play_token_chat(codec, script, episodes: int) -> float:
    """Seconds per model turn with TokenChat."""
    from agentrl.episode.chat import TokenChat

    model = [(codec.encode(text) + [codec.end_of_turn_id], obs) for text, obs in script]
    TokenChat.start(codec, START, TOOLS)  # the prompt cache is warm, as for the n samples of a group
    spent = 0.0
    for _ in range(episodes):
        chat = TokenChat.start(codec, START, TOOLS)
        t = time.process_time()
        for ids, obs in model:
            chat.append_model(ids, [0.0] * len(ids), [0] * len(ids))
            chat.close_turn_and_add(obs)
        spent += time.process_time() - t
    return spent / (episodes * len(script))


def play_full_render(codec, script, episodes: int) -> float:
    """Seconds per model turn with the whole-chat rendering delta (the reference)."""
    eot = codec.end_of_turn_text
    model = [(codec.encode(text) + [codec.end_of_turn_id], text, obs) for text, obs in script]
    prompt_ids, prompt_text = codec.prompt(START, TOOLS)
    spent = 0.0
    for _ in range(episodes):
        messages, tokens, text = [dict(m) for m in START], list(prompt_ids), prompt_text
        t = time.process_time()
        for ids, content, obs in model:
            tokens.extend(ids)
            messages.append({"role": "assistant", "content": content})
            rendered = codec.render(messages + obs, TOOLS, bool(obs), plain=True)
            expected = text + content + eot
            assert rendered.startswith(expected), "not prefix-stable"
            tokens.extend(codec.encode(rendered[len(expected) :]))
            messages.extend(obs)
            text = rendered
        spent += time.process_time() - t
    return spent / (episodes * len(script))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5, help="alternations of the two methods")
    parser.add_argument("--turns", type=int, nargs="+", default=[1, 3, 8], help="tool-call turns per episode")
    parser.add_argument("--families", nargs="+", default=["tiny", "qwen2_5", "qwen3", "llama3_1"])
    parser.add_argument("--model", default="", help="a tiny model's folder: its tokenizer is the tiny family's")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args()
    if args.smoke:  # flags given explicitly still win
        parser.set_defaults(**SMOKE)
        args = parser.parse_args()
    from agentrl.episode.chat import codec_for

    print(f"{'template':10} {'turns':>5} {'TokenChat us/turn':>18} {'full render us/turn':>20} {'ratio':>6}")
    for family in args.families:
        codec = codec_for(tokenizer_for(family, args.model))
        t = time.process_time()
        for _ in range(200):
            codec.render(START, TOOLS, True)
        prompt_us = (time.process_time() - t) / 200 * 1e6
        for n in args.turns:
            script = turns(family, n)
            stable = not family.startswith("qwen3")
            new = ref = 0.0
            for _ in range(args.rounds):  # interleaved, so that a change in the machine's load hits both
                new += play_token_chat(codec, script, args.episodes // args.rounds) * 1e6 / args.rounds
                if stable:
                    ref += play_full_render(codec, script, args.episodes // args.rounds) * 1e6 / args.rounds
            if not stable:
                print(f"{family:10} {n + 1:5d} {new:18.1f} {'(not prefix-stable)':>20} {'':>6}")
                continue
            print(f"{family:10} {n + 1:5d} {new:18.1f} {ref:20.1f} {new / ref:6.2f}")
        print(f"{family:10} prompt render (once per group): {prompt_us:.1f} us")


if __name__ == "__main__":
    main()
