"""Instruction prompts of the environments (paper Appendix "Prompts").

ALFWorld, SciWorld and WebShop are the paper's text verbatim (layout
normalised to plain text); TextCraft follows the same pattern (ETO / AgentGym
style) since the paper does not evaluate it.
"""
from __future__ import annotations

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

BUILTIN_PROMPTS = {"lamps": LAMPS, "lamps-hard": LAMPS_HARD}


def instruction_prompt(env: str) -> str:
    try:
        return PROMPTS[env] if env in PROMPTS else BUILTIN_PROMPTS[env]
    except KeyError:
        raise KeyError(f"unknown environment {env!r} (known: {', '.join(sorted({**PROMPTS, **BUILTIN_PROMPTS}))})") from None
