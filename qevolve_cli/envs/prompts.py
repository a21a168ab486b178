"""Instruction prompts of the environments (paper Appendix "Prompts").

ALFWorld, SciWorld and WebShop are the paper's text verbatim (layout
normalised to plain text); TextCraft follows the same pattern (ETO / AgentGym
style) since the paper does not evaluate it.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

ALFWORLD = """Interact with a household to solve a task. Imagine you are an intelligent agent in a household environment and your target is to perform actions to complete the task goal. At the beginning of your interactions, you will be given the detailed description of the current environment and your goal to accomplish.
For each of your turns, you will be given the observation from the last turn. You should first think about the current condition and plan your future actions, and then output your action in this turn. Your output must strictly follow this format:
Thought: your thoughts.
Action: your next action.

The available actions are:
1. go to {recep}
2. take {obj} from {recep}
3. put {obj} in/on {recep}
4. open {recep}
5. close {recep}
6. toggle {obj} {recep}
7. clean {obj} with {recep}
8. heat {obj} with {recep}
9. cool {obj} with {recep}
where {obj} and {recep} correspond to objects and receptacles.
After each turn, the environment will give you immediate feedback based on which you plan your next few steps. If the environment outputs "Nothing happened", that means the previous action is invalid and you should try more options.

Your response should use the following format:
Thought: <your thoughts>
Action: <your next action>"""

SCIWORLD = """You are a helpful assistant to do some scientific experiment in an environment.
In the environment, there are several rooms: kitchen, foundry, workshop, bathroom, outside, living room, bedroom, greenhouse, art studio, hallway
You should explore the environment and find the items you need to complete the experiment.
You can teleport to any room in one step.
All containers in the environment have already been opened, you can directly get items from the containers.

The available actions are:
open OBJ: open a container
close OBJ: close a container
activate OBJ: activate a device
deactivate OBJ: deactivate a device
connect OBJ to OBJ: connect electrical components
disconnect OBJ: disconnect electrical components
use OBJ [on OBJ]: use a device/item
look around: describe the current room
examine OBJ: describe an object in detail
look at OBJ: describe a container's contents
read OBJ: read a note or book
move OBJ to OBJ: move an object to a container
pick up OBJ: move an object to the inventory
pour OBJ into OBJ: pour a liquid into a container
mix OBJ: chemically mix a container
teleport to LOC: teleport to a specific room
focus on OBJ: signal intent on a task object
wait: task no action for 10 steps
wait1: task no action for a step

Your response should use the following format:

Thought: <your thoughts>
Action: <your next action>"""

WEBSHOP = """You are web shopping.
I will give you instructions about what to do.
You have to follow the instructions.
Every round I will give you an observation and a list of available actions, you have to respond an action based on the state and instruction.
You can use search action if search is available.
You can click one of the buttons in clickables.
An action should be of the following structure:
search[keywords]
click[value]
If the action is not valid, perform nothing. Keywords in search are up to you, but the value in click must be a value in the list of available actions. Remember that your keywords in search should be carefully designed.
Your response should use the following format:
Thought: I think ...
Action: click[something]"""

TEXTCRAFT = """You are given a few useful crafting recipes to craft items in Minecraft. Crafting commands are of the format "craft [target object] using [input ingredients]".
Every round I will give you an observation, you have to respond an action based on the state and instruction. You can "get" an object (ingredients) from the inventory or the environment, look up the game inventory by "inventory", or "craft" (target) using any of the crafting commands. You can use ONLY these crafting commands provided, do not use your own crafting commands. However, if the crafting command uses a generic ingredient like "planks", you can use special types of the same ingredient e.g. "dark oak planks" in the command instead.

Your response should use the following format:
Thought: <your thoughts>
Action: <your next action>"""

PROMPTS = {"alfworld": ALFWORLD, "sciworld": SCIWORLD, "webshop": WEBSHOP, "textcraft": TEXTCRAFT}

# Built-in environments (qevolve_cli/envs/builtin.py), same pattern. Kept out of PROMPTS on purpose:
# PROMPTS is part of the tiny model's tokenizer corpus (models/tiny.py), which must not change.
LAMPS = """You are in a house of eight rooms along a corridor from west to east, each with one lamp. Your task names the rooms whose lamps you must turn on, in order.
For each of your turns, you will be given the observation from the last turn. Think about what is done and what is left, then output your action.

The available actions are:
1. go east
2. go west
3. turn on lamp
4. turn off lamp
5. look
If the environment outputs "Nothing happens", that means the previous action is invalid.

Your response should use the following format:
Thought: <your thoughts>
Action: <your next action>"""

LAMPS_HARD = LAMPS.replace(
    "Your task names the rooms whose lamps you must turn on, in order.",
    "Your task names the rooms whose lamps you must turn on, in order, and the most steps you may take: "
    "every step counts, a wrong way costs two.")

BUILTIN_PROMPTS = {"lamps": LAMPS, "lamps-hard": LAMPS_HARD, "lamps-habit": LAMPS_HARD}


def instruction_prompt(env: str) -> str:
    try:
        return PROMPTS[env] if env in PROMPTS else BUILTIN_PROMPTS[env]
    except KeyError:
        raise KeyError(f"unknown environment {env!r} (known: {', '.join(sorted({**PROMPTS, **BUILTIN_PROMPTS}))})") from None


# --------------------------------------------------------------------------- in-context examples
# One solved task per environment, shown to pretrained chat models before their task (ETO's layout:
# the example in a user turn, the model's "OK", then the task; qevolve_cli/transcript.py, docs/rollout.md).
# Built-in and package environments: a real expert episode of a *train* task (lamps: the expert's
# commands with thoughts that read the hints; tests/test_prompts.py replays the lamps ones), written
# in the transcript's own format (``Task:`` / ``Observation:`` / ``Thought:`` / ``Action:`` lines).
# WebShop has no local expert: its example is illustrative (same page layout as the server's).


@dataclass(frozen=True)
class Example:
    """A solved task: its instruction, (observation, model output) per step and the final observation."""

    task_id: str
    instruction: str
    steps: tuple[tuple[str, str], ...]
    final: str

    def render(self) -> str:
        lines = [f"Task: {self.instruction}"]
        for obs, out in self.steps:
            lines += [f"Observation: {obs}", out]
        lines.append(f"Observation: {self.final}")
        return "\n".join(lines)

    def commands(self) -> list[str]:
        return [out.rsplit("Action:", 1)[1].strip() for _, out in self.steps]


def _react(thought: str, command: str) -> str:
    return f"Thought: {thought}\nAction: {command}"


_GO = "The next lamp is to the {d}, so I go {d}."
_KEEP = "This is not the room of the next lamp yet, so I keep going {d}."
_ON = "This is the room of the next lamp, so I turn it on."
_HERE = "The next lamp is here, so I turn it on."

LAMPS_EXAMPLE = Example(
    task_id="lamps:bathroom:hallway+bedroom",
    instruction="turn on the lamp in the hallway, then in the bedroom",
    steps=(
        ("You are in the bathroom. The lamp here is off. The next lamp to turn on is to the east.",
         _react(_GO.format(d="east"), "go east")),
        ("You are in the hallway. The lamp here is off. This is the room of the next lamp.",
         _react(_ON, "turn on lamp")),
        ("You turn on the lamp in the hallway. The next lamp to turn on is to the west.",
         _react(_GO.format(d="west"), "go west")),
        ("You are in the bathroom. The lamp here is off.", _react(_KEEP.format(d="west"), "go west")),
        ("You are in the bedroom. The lamp here is off. This is the room of the next lamp.",
         _react(_ON, "turn on lamp")),
    ),
    final="You turn on the lamp in the bedroom. All the lamps of the task are on.",
)

LAMPS_HARD_EXAMPLE = Example(
    task_id="lamps-hard:workshop:hallway+bathroom+greenhouse",
    instruction="turn on the lamp in the hallway, then in the bathroom, then in the greenhouse, in at most 10 steps",
    steps=(
        ("You are in the workshop. The lamp here is off. The next lamp to turn on is to the west.",
         _react(_GO.format(d="west"), "go west")),
        ("You are in the hallway. The lamp here is off. This is the room of the next lamp.",
         _react(_ON, "turn on lamp")),
        ("You turn on the lamp in the hallway. The next lamp to turn on is to the west.",
         _react(_GO.format(d="west"), "go west")),
        ("You are in the bathroom. The lamp here is off. This is the room of the next lamp.",
         _react(_ON, "turn on lamp")),
        ("You turn on the lamp in the bathroom. The next lamp to turn on is to the east.",
         _react(_GO.format(d="east"), "go east")),
        ("You are in the hallway. The lamp here is on.", _react(_KEEP.format(d="east"), "go east")),
        ("You are in the workshop. The lamp here is off.", _react(_KEEP.format(d="east"), "go east")),
        ("You are in the greenhouse. The lamp here is off. This is the room of the next lamp.",
         _react(_ON, "turn on lamp")),
    ),
    final="You turn on the lamp in the greenhouse. All the lamps of the task are on.",
)


def _expert(thought_cmds: list[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    return tuple((obs, _react(f"The next step towards the goal is to {cmd}.", cmd)) for obs, cmd in thought_cmds)


TEXTCRAFT_EXAMPLE = Example(
    task_id="textcraft:brick_stairs",
    instruction="craft brick stairs",
    steps=_expert([
        ("Crafting commands:\ncraft 6 brick slab using 3 bricks\ncraft 6 brick wall using 6 bricks\n"
         "craft 1 flower pot using 3 brick\ncraft 4 brick stairs using 6 bricks\ncraft 1 bricks using 4 brick\n\n"
         "Goal: craft brick stairs.", "get 24 brick"),
        ("Got 24 brick", "craft 1 bricks using 4 brick"),
        *[("Crafted 1 minecraft:bricks", "craft 1 bricks using 4 brick")] * 5,
        ("Crafted 1 minecraft:bricks", "craft 4 brick stairs using 6 bricks"),
    ]),
    final="Crafted 4 minecraft:brick_stairs",
)

ALFWORLD_EXAMPLE = Example(
    task_id="alfworld:train/look_at_obj_in_light-AlarmClock-None-DeskLamp-304/trial_T20190909_152102_649589",
    instruction="examine the alarmclock with the desklamp.",
    steps=_expert([
        ("You are in the middle of a room. Looking quickly around you, you see a bed 2, a bed 1, a desk 1, "
         "a drawer 3, a drawer 2, a drawer 1, a garbagecan 1, a laundryhamper 1, and a shelf 1.", "go to shelf 1"),
        ("You arrive at loc 4. On the shelf 1, you see a alarmclock 3, a cellphone 2, a desklamp 1, a pencil 2, "
         "and a pencil 1.", "take alarmclock 3 from shelf 1"),
        ("You pick up the alarmclock 3 from the shelf 1.", "use desklamp 1"),
    ]),
    final="You turn on the desklamp 1.",
)

_OUTSIDE = ("This outside location is called the outside. Here you see: \n\tthe agent\n\ta substance called air\n"
            "\tan axe\n\ta blue jay egg\n\ta butterfly egg\n\ta dove egg\n\ta fire pit (containing nothing)\n"
            "\ta fountain (containing a substance called water)\n\tthe ground\n\ta substance called wood\n"
            "You also see:\n\tA door to the foundry (that is open)\n\tA door to the greenhouse (that is open)\n"
            "\tA door to the kitchen (that is open)")
SCIWORLD_EXAMPLE = Example(
    task_id="sciworld:task-3-find-animal:0",
    instruction="Your task is to find a(n) animal. First, focus on the thing. Then, move it to the red box in the "
                "kitchen.",
    steps=_expert([
        ("This room is called the hallway. In it, you see: \n\tthe agent\n\ta substance called air\n\ta picture\n"
         "You also see:\n\tA door to the art studio (that is open)\n\tA door to the bedroom (that is open)\n"
         "\tA door to the greenhouse (that is open)\n\tA door to the kitchen (that is open)\n"
         "\tA door to the living room (that is open)\n\tA door to the workshop (that is open)", "open door to greenhouse"),
        ("The door is already open.", "go to greenhouse"),
        ("You move to the greenhouse.", "open door to outside"),
        ("The door is already open.", "go to outside"),
        ("You move to the outside.", "look around"),
        (_OUTSIDE, "focus on dove"),
        ("You focus on the dove egg.", "pick up dove"),
        ("You move the dove to the inventory.", "open door to kitchen"),
        ("The door is already open.", "go to kitchen"),
        ("You move to the kitchen.", "move egg dove egg in inventory to red box"),
    ]),
    final="You move the dove to the red box.",
)

WEBSHOP_EXAMPLE = Example(
    task_id="webshop:illustrative",
    instruction="i need a long clip-in hair extension which is natural looking, and price lower than 40.00 dollars",
    steps=(
        ("WebShop [SEP] Instruction: [SEP] i need a long clip-in hair extension which is natural looking, and "
         "price lower than 40.00 dollars [SEP] Search",
         _react("I should search for long clip-in natural looking hair extensions.",
                "search[long clip-in hair extension natural looking]")),
        ("Instruction: [SEP] i need a long clip-in hair extension which is natural looking, and price lower than "
         "40.00 dollars [SEP] Back to Search [SEP] Page 1 (Total results: 50) [SEP] Next > [SEP] B09QQLDJ93 [SEP] "
         "Clip in Hair Extensions Long Straight Natural Hairpiece [SEP] $25.99 [SEP] B093BKWHFK [SEP] Human Hair "
         "Clip in Extensions 22 inch [SEP] $89.0",
         _react("The first item is a long natural clip-in extension under 40 dollars. I will check it.",
                "click[B09QQLDJ93]")),
        ("Instruction: [SEP] i need a long clip-in hair extension which is natural looking, and price lower than "
         "40.00 dollars [SEP] Back to Search [SEP] < Prev [SEP] Clip in Hair Extensions Long Straight Natural "
         "Hairpiece [SEP] Price: $25.99 [SEP] Rating: N.A. [SEP] Description [SEP] Features [SEP] Reviews [SEP] "
         "Buy Now",
         _react("It matches the instruction and the price is below 40 dollars. I will buy it.", "click[Buy Now]")),
    ),
    final="Thank you for shopping with us! [SEP] Your code: [SEP] None [SEP] Your score (min 0.0, max 1.0) [SEP] 1.0",
)

LAMPS_HABIT_EXAMPLE = replace(
    LAMPS_HARD_EXAMPLE, task_id="lamps-habit:workshop:hallway+bathroom+greenhouse",
    instruction=LAMPS_HARD_EXAMPLE.instruction.replace("10 steps", "9 steps"))  # its tight budget

EXAMPLES = {"lamps": LAMPS_EXAMPLE, "lamps-hard": LAMPS_HARD_EXAMPLE, "lamps-habit": LAMPS_HABIT_EXAMPLE, "textcraft": TEXTCRAFT_EXAMPLE,
            "alfworld": ALFWORLD_EXAMPLE, "sciworld": SCIWORLD_EXAMPLE, "webshop": WEBSHOP_EXAMPLE}
EXAMPLE_INTRO = "Here is an example."


def example_prompt(env: str) -> str:
    """The in-context example of ``env`` as the text of one user message (intro + the solved task)."""
    try:
        ex = EXAMPLES[env]
    except KeyError:
        raise KeyError(f"unknown environment {env!r} (known: {', '.join(sorted(EXAMPLES))})") from None
    return f"{EXAMPLE_INTRO}\n{ex.render()}"
