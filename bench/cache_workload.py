"""The agent-like workload of `make bench-cache` (bench/bench_cache.py), made from a seed.

Every conversation opens with the same long system message: an agent's instructions, then
tool definitions written into it as Qwen's and Hermes' chat templates render a `tools` list
(the tiny model's template has no tools section, and a `tools` field would make llama-server
constrain the answer by grammar, which prices nothing we measure). Then its own task (the
first user message, which is also what crossbar's fingerprint names the conversation by),
and, turn after turn, what an agent adds: the model's tool call (an assistant message) and the
tool's result (a `tool` message), so each request is the last one's messages plus two. Between
turns the agent runs its tool: a pause. Conversations start in bursts.

The bench writes the assistant messages itself rather than keeping what the model answered:
with random weights the answer is noise, and its text would depend on batching, so the
requests would differ from one policy to the next. Pure: the same `Shape` and seed give the
same workload, byte for byte.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

__all__ = ["Conversation", "Shape", "Turn", "Workload", "make_workload"]

# Plain words of an engineering conversation: they tokenize as English does (1-2 tokens each
# in llama's vocab), so prompt sizes in words say what they cost in tokens.
WORDS = (
    "the a of to and in is it that for on with as this be are by not from or at an which "
    "file function module test change error value request response server host cache slot "
    "queue model token prompt answer config route lease time memory process thread loop "
    "build check run read write list search call return raise import class method field "
    "type string number list table row column index key path line output input result "
    "before after when while until every each other first last next new old same small "
    "large long short fast slow busy free open close start stop wait send keep move find "
    "should must may can will would could make take give show tell know want need use try "
    "because so but if then else also only still again never always here there where how"
).split()

TOOL_NAMES = (
    "read_file", "write_file", "list_directory", "search_code", "run_tests", "run_command",
    "git_diff", "git_log", "fetch_url", "open_issue", "edit_lines", "format_code",
)  # fmt: skip

INSTRUCTIONS = (
    "You are a coding agent working in a repository on behalf of an engineer. Read before "
    "you write, run the tests after every change, and say what you did in a few lines. "
)

TOOLS_HEADER = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
)
TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


@dataclass(frozen=True, slots=True)
class Shape:
    """How big the workload is; bench_cache.py's options, with their defaults there."""

    conversations: int
    turns: int  # requests per conversation
    bursts: int  # conversations start in this many groups (1: all at once)
    burst_gap: float  # seconds between one burst's start and the next's
    pause: tuple[float, float]  # the agent's tool run between turns: uniform, seconds
    instruction_words: int  # the system message's prose, before the tools
    tools: int  # tool definitions in the system message (at most len(TOOL_NAMES))
    tool_words: int  # each tool's description
    task_words: int  # each conversation's first user message
    result_words: tuple[int, int]  # each tool result: uniform, words
    max_tokens: int  # what each request asks the model to generate


@dataclass(frozen=True, slots=True)
class Turn:
    messages: tuple[dict[str, str], ...]  # the whole request's messages
    pause_after: float  # seconds before the conversation's next turn (0 after the last)


@dataclass(frozen=True, slots=True)
class Conversation:
    number: int
    start: float  # seconds after the phase began
    turns: tuple[Turn, ...]


@dataclass(frozen=True, slots=True)
class Workload:
    shape: Shape
    seed: int
    opening: str  # the system message all conversations share
    conversations: tuple[Conversation, ...]

    @property
    def requests(self) -> int:
        return sum(len(conversation.turns) for conversation in self.conversations)


def make_workload(shape: Shape, seed: int) -> Workload:
    """The workload `shape` describes, drawn from `seed`. Raises ValueError for a shape with
    more tools than TOOL_NAMES or no conversation, turn or burst."""
    if shape.tools > len(TOOL_NAMES):
        raise ValueError(f"at most {len(TOOL_NAMES)} tools, not {shape.tools}")
    if min(shape.conversations, shape.turns, shape.bursts) < 1:
        raise ValueError("a workload needs a conversation, a turn and a burst")
    # A generator per part, so that changing one part's size leaves the others' text alone.
    opening = _opening(shape, random.Random(f"{seed}/opening"))
    per_burst = -(-shape.conversations // shape.bursts)
    conversations = tuple(
        _conversation(shape, opening, number, (number // per_burst) * shape.burst_gap,
                      random.Random(f"{seed}/conversation/{number}"))
        for number in range(shape.conversations)
    )  # fmt: skip
    return Workload(shape, seed, opening, conversations)


def _words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


def _opening(shape: Shape, rng: random.Random) -> str:
    tools = [
        {
            "type": "function",
            "function": {
                "name": name,
                "description": _words(rng, shape.tool_words),
                "parameters": {
                    "type": "object",
                    "properties": {
                        "path": {"type": "string", "description": _words(rng, 8)},
                        "query": {"type": "string", "description": _words(rng, 8)},
                        "limit": {"type": "integer", "description": _words(rng, 6)},
                    },
                    "required": ["path"],
                },
            },
        }
        for name in TOOL_NAMES[: shape.tools]
    ]
    prose = INSTRUCTIONS + _words(rng, shape.instruction_words) + "."
    return prose + TOOLS_HEADER + "\n".join(json.dumps(tool) for tool in tools) + TOOLS_FOOTER


def _conversation(
    shape: Shape, opening: str, number: int, burst_start: float, rng: random.Random
) -> Conversation:
    messages: list[dict[str, str]] = [
        {"role": "system", "content": opening},
        {"role": "user", "content": f"Task {number}: {_words(rng, shape.task_words)}."},
    ]
    turns = []
    for turn in range(shape.turns):
        last = turn == shape.turns - 1
        pause = 0.0 if last else round(rng.uniform(*shape.pause), 3)
        turns.append(Turn(tuple(messages), pause))
        name = rng.choice(TOOL_NAMES[: max(1, shape.tools)])
        call = {"name": name, "arguments": {"path": f"src/part_{rng.randrange(100)}.py"}}
        messages.append(
            {"role": "assistant", "content": f"<tool_call>\n{json.dumps(call)}\n</tool_call>"}
        )
        messages.append({"role": "tool", "content": _words(rng, rng.randint(*shape.result_words))})
    start = burst_start + round(rng.uniform(0, 0.25), 3)  # a burst's arrivals, not one instant
    return Conversation(number, start, tuple(turns))
