"""Offline ALFWorld game generator: TextWorld games built from the scene data shipped in the ``alfworld`` wheel.

The official ALFWorld games (3,553 train, 274 evaluation) are downloaded by ``alfworld-download`` from
a host that may be unreachable. This module writes games of the same format, in the same layout
(``json_2.1.1/<split>/<task_type>-<object>-<mrecep>-<target>-<scene>/<trial>/game.tw-pddl`` plus
``traj_data.json``), that :class:`~torchrl_agent.envs.alfworld.ALFWorldEnv` plays like the real ones.

What a game is made of, and where each part comes from:

* ``pddl_domain``: the wheel's ``alfworld/data/alfred.pddl``, verbatim (the real games embed it too).
* ``grammar``: the wheel's ``alfworld/data/alfred.twl2`` with its ``UNKNOWN GOAL`` replaced by a
  templated goal of ``alfworld.gen.goal_library`` (what ``alfworld-generate`` does).
* ``pddl_problem``: written in the format of the real games' ``initial_state.pddl`` (the one real
  game is the template: its object/constant declarations, fact families and goal layout), from:

  - the scene: ``alfworld/gen/layouts/FloorPlan<N>-objects.json`` (which object and receptacle types
    the THOR scene holds), ``FloorPlan<N>-openable.json`` (receptacle instances, with their THOR ids
    and the agent pose to interact with them: ``loc|x/0.25|z/0.25|rotation/90|horizon``; these are
    the receptacles that get the ``openable`` fact when their class is openable, as in the real
    game) and ``FloorPlan<N>-layout.npy`` (the reachable floor points);
  - *derived, not shipped*: at most :data:`MAX_SAME_RECEPTACLES` receptacles of one class are
    kept (drawn per scene), so a scene has the size of a real game (the real FloorPlan14 game has
    20 receptacles; some shipped scenes list 50): a go-to action is grounded for every pair of
    locations, so larger scenes load and step several times slower;
  - *derived, not shipped*: a receptacle type listed in ``objects.json`` without an instance in
    ``openable.json`` (e.g. a kitchen's stove burners, toaster, coffee machine, garbage can) gets
    instances placed at reachable points drawn for the scene (4 stove burners, else 1); these are
    never openable. Their ids follow THOR's ``Type|+x.xx|+y.yy|+z.zz`` format with made-up
    coordinates;
  - *sampled per game*: the pickable objects of the scene's types (1 to 3 instances each; ALFRED's
    ``MAX_NUM_OF_OBJ_INSTANCES``), each put in a receptacle whose class may hold it
    (``alfworld.gen.constants.VAL_RECEPTACLE_OBJECTS``); desk/floor lamps on a table-like
    receptacle; the agent's start at a reachable point. Object properties (``pickupable``,
    ``cleanable``, ``heatable``, ``coolable``, ``sliceable``, ``isReceptacleObject``,
    ``toggleable``) and ``canContain`` follow ``constants.VAL_ACTION_OBJECTS`` /
    ``VAL_RECEPTACLE_OBJECTS`` / ``MOVABLE_RECEPTACLES``; the goal is ``goal_library``'s PDDL goal.
    Scenery objects that play no part in the text game (windows, chairs, light switches, ...) are
    left out. For "pick two" tasks both target objects start in one receptacle that need not be
    opened: ALFWorld's hand-coded expert fails most other placements (it looks for the second
    object only where it saw the first, and does not reopen a receptacle it closed).

* the task: one of the six task types, with the constraints ALFRED's sampler enforces (the scene
  has the object and the target receptacle, the target class can hold the object, a microwave /
  fridge / sink basin / lamp exists for heat / cool / clean / look tasks, two instances for "pick
  two", no instance starts in the target so the game is not won at the start).
* ``solvable``: every game is played by ALFWorld's hand-coded expert through the environment and
  kept only when the expert wins within ``max_expert_steps`` (50, the episode limit); its
  commands are stored as ``walkthrough``.

Splits: training games use ALFRED's training floor plans (``constants.TRAIN_SCENE_NUMBERS``:
7-30, 207-230, 307-330, 407-430); ``valid_unseen`` (out of distribution) its held-out floor plans
(``constants.TEST_SCENE_NUMBERS``: 1-6, 201-206, 301-306, 401-406), unseen in training;
``valid_seen`` (in distribution, the reference's default ``eval_in_distribution``) new games on the
training floor plans, drawn from a seed stream disjoint from the training games'. Generation is
deterministic for a seed.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Sequence

import numpy as np

from torchrl_agent.envs.alfworld.files import TASK_TYPES
from torchrl_agent.envs.alfworld.game import ALFWorldGame

__all__ = ["GENERATOR_VERSION", "SPLITS", "generate_games", "generated_data_dir", "make_game", "scene"]

#: Bump when the generated games change: the cache folder is keyed by it.
GENERATOR_VERSION = "1"
#: The data splits the generator writes: train and valid_seen draw from ALFRED's training scenes,
#: valid_unseen from its held-out scenes.
SPLITS = ("train", "valid_unseen", "valid_seen")
#: The splits of :func:`generated_data_dir` by default (an env asks for the one it plays).
_BASE_SPLITS = ("train", "valid_unseen")
#: valid_seen's game seeds start here, past any training game's seed (``seed * 1_000_003 + attempt``).
_SEEN_SEED_OFFSET = 500_000

#: at most this many receptacles of one class in a scene (cabinets, drawers, shelves)
MAX_SAME_RECEPTACLES = 6
_LAMPS = ("DeskLamp", "FloorLamp")
_LAMP_HOLDERS = ("SideTable", "Desk", "Dresser", "DiningTable", "CoffeeTable", "Shelf", "TVStand", "CounterTop")
_BASIN_SUFFIXES = ("SinkBasin", "BathtubBasin")
_TASK_APPLIANCE = {
    "pick_clean_then_place_in_recep": "SinkBasin",
    "pick_heat_then_place_in_recep": "Microwave",
    "pick_cool_then_place_in_recep": "Fridge",
}


def _constants():
    import alfworld.gen.constants as constants

    return constants


def _layouts_dir() -> str:
    import alfworld.gen

    return os.path.join(os.path.dirname(alfworld.gen.__file__), "layouts")


def floor_plans(split: str) -> list[int]:
    """The floor plans of ``split`` that the wheel ships layouts for."""
    c = _constants()
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    numbers = c.TEST_SCENE_NUMBERS if split == "valid_unseen" else c.TRAIN_SCENE_NUMBERS
    folder = _layouts_dir()
    return [n for n in numbers if os.path.isfile(os.path.join(folder, f"FloorPlan{n}-openable.json"))]


def mangle(name: str) -> str:
    """THOR id -> PDDL name, as ALFRED writes it (``Cabinet|+01.66|...`` -> ``Cabinet_bar__plus_01_dot_66...``)."""
    for old, new in (("-", "_minus_"), ("|", "_bar_"), ("+", "_plus_"), (".", "_dot_"), (",", "_comma_")):
        name = name.replace(old, new)
    return name


def _coord(value: float) -> str:
    return f"{value:+06.2f}"


def _location(x: float, z: float, rotation: float, horizon: float) -> str:
    return f"loc|{int(round(x / 0.25))}|{int(round(z / 0.25))}|{int(round(rotation / 90)) % 4}|{int(round(horizon))}"


def _receptacle_type(thor_id: str) -> str:
    parts = thor_id.split("|")
    return parts[-1] if parts[-1].endswith(_BASIN_SUFFIXES) else parts[0]


def scene(floor_plan: int) -> dict:
    """The fixed structure of a floor plan: receptacles (id, type, location, openable), object types, floor points.

    Deterministic: the receptacles the wheel does not ship are placed from a generator seeded by
    the floor plan number alone, so every game of a scene shares its receptacles.
    """
    c = _constants()
    folder = _layouts_dir()
    with open(os.path.join(folder, f"FloorPlan{floor_plan}-objects.json")) as f:
        types = list(json.load(f))
    with open(os.path.join(folder, f"FloorPlan{floor_plan}-openable.json")) as f:
        poses = json.load(f)
    points = np.load(os.path.join(folder, f"FloorPlan{floor_plan}-layout.npy"))
    static = set(c.RECEPTACLES) - set(c.MOVABLE_RECEPTACLES)
    receptacles = []
    for thor_id, (x, z, rotation, horizon) in sorted(poses.items()):
        rtype = _receptacle_type(thor_id)
        if rtype not in static:
            continue
        receptacles.append({"id": thor_id, "type": rtype, "location": _location(x, z, rotation, horizon),
                            "openable": rtype in c.OPENABLE_CLASS_SET})
    rng = np.random.default_rng([floor_plan, 7])
    # keep the scene the size of a real ALFWorld game (FloorPlan14's has 20 receptacles): at most
    # MAX_SAME_RECEPTACLES of a class, dropped at random (every go-to pairs all locations).
    by_type: dict[str, list[dict]] = {}
    for r in receptacles:
        by_type.setdefault(r["type"], []).append(r)
    receptacles = []
    for rtype in sorted(by_type):
        group = by_type[rtype]
        if len(group) > MAX_SAME_RECEPTACLES:
            keep = sorted(rng.choice(len(group), size=MAX_SAME_RECEPTACLES, replace=False))
            group = [group[int(k)] for k in keep]
        receptacles += group
    present = {r["type"] for r in receptacles}
    used = {r["location"] for r in receptacles}
    for rtype in sorted(set(types) & (static - present - {"PaintingHanger"})):
        for _ in range(4 if rtype == "StoveBurner" else 1):
            for _attempt in range(100):
                x, z = (float(v) for v in points[int(rng.integers(len(points)))])
                location = _location(x, z, 90 * int(rng.integers(4)), 30)
                if location not in used:
                    break
            used.add(location)
            y = float(rng.uniform(0.0, 1.0))
            thor_id = f"{rtype}|{_coord(x + rng.uniform(-0.5, 0.5))}|{_coord(y)}|{_coord(z + rng.uniform(-0.5, 0.5))}"
            receptacles.append({"id": thor_id, "type": rtype, "location": location, "openable": False})
    return {"floor_plan": floor_plan, "types": types, "receptacles": receptacles,
            "points": [(float(x), float(z)) for x, z in points]}


def _holders(c, receptacles, otype):
    return [r for r in receptacles if otype in c.VAL_RECEPTACLE_OBJECTS.get(r["type"], ())]


def _sample_task(rng, c, sc, task_type):
    """A (object, target receptacle type, lamp type) for ``task_type`` in scene ``sc``, or None."""
    receptacles = sc["receptacles"]
    rtypes = {r["type"] for r in receptacles}
    pickable = sorted(t for t in set(sc["types"]) if _holders(c, receptacles, t) and "Sliced" not in t)
    if task_type == "look_at_obj_in_light":
        lamps = [t for t in _LAMPS if t in sc["types"]]
        if not lamps or not any(r["type"] in _LAMP_HOLDERS for r in receptacles) or not pickable:
            return None
        return str(rng.choice(pickable)), "", str(rng.choice(lamps))
    appliance = _TASK_APPLIANCE.get(task_type)
    if appliance is not None and appliance not in rtypes:
        return None
    action_set = {"pick_clean_then_place_in_recep": "Cleanable", "pick_heat_then_place_in_recep": "Heatable",
                  "pick_cool_then_place_in_recep": "Coolable"}.get(task_type)
    candidates = []
    for otype in pickable:
        if action_set is not None and otype not in c.VAL_ACTION_OBJECTS[action_set]:
            continue
        for rtype in sorted(rtypes):
            if rtype == appliance or otype not in c.VAL_RECEPTACLE_OBJECTS.get(rtype, ()):
                continue
            # the object must have somewhere to start other than the target class
            if not any(r["type"] != rtype for r in _holders(c, receptacles, otype)):
                continue
            candidates.append((otype, rtype))
    if not candidates:
        return None
    otype, rtype = candidates[int(rng.integers(len(candidates)))]
    return otype, rtype, ""


def make_game(floor_plan: int, task_type: str, seed: int) -> dict | None:
    """Build one game (not yet checked by the expert) as ``{"game": ..., "traj_data": ..., "folder": ...}``.

    Returns None when the scene cannot host ``task_type`` (e.g. no microwave for a heat task).
    """
    if task_type not in TASK_TYPES:
        raise ValueError(f"task_type must be one of {TASK_TYPES}, got {task_type!r}")
    import alfworld.gen.goal_library as goal_library
    from alfworld.info import ALFRED_PDDL_PATH, ALFRED_TWL2_PATH

    c = _constants()
    rng = np.random.default_rng([seed, floor_plan, TASK_TYPES.index(task_type)])
    sc = scene(floor_plan)
    task = _sample_task(rng, c, sc, task_type)
    if task is None:
        return None
    target_object, target_receptacle, toggle = task
    receptacles = sc["receptacles"]

    # objects: every pickable type of the scene, 1..3 instances each (2..3 of the target for "pick two")
    objects = []  # (thor id, type, receptacle)
    taken = set()
    pickable = sorted(t for t in set(sc["types"]) if _holders(c, receptacles, t) and "Sliced" not in t)
    for otype in pickable:
        holders = _holders(c, receptacles, otype)
        if otype == target_object and target_receptacle:
            holders = [r for r in holders if r["type"] != target_receptacle]
        low = 1
        if otype == target_object and task_type == "pick_two_obj_and_place":
            # ALFWorld's hand-coded expert finds the second object only where it saw the first,
            # in a receptacle it need not reopen: put both there (the expert filter rejects the rest)
            low = 2
            holders = [r for r in holders if not r["openable"]] or holders
            holders = [holders[int(rng.integers(len(holders)))]]
        for _ in range(int(rng.integers(low, c.MAX_NUM_OF_OBJ_INSTANCES + 1))):
            objects.append((otype, holders[int(rng.integers(len(holders)))]))
    if toggle:
        lamp_holders = [r for r in receptacles if r["type"] in _LAMP_HOLDERS]
        objects.append((toggle, lamp_holders[int(rng.integers(len(lamp_holders)))]))
    named = []
    for otype, holder in objects:
        _, x, y, z = (holder["id"].split("|") + ["0", "0", "0"])[:4]
        for _attempt in range(100):
            thor_id = "|".join([otype] + [_coord(float(v) + rng.uniform(-0.4, 0.4)) for v in (x, y, z)])
            if thor_id not in taken:
                break
        taken.add(thor_id)
        named.append((thor_id, otype, holder))

    # the agent starts at a floor point that is no receptacle's
    receptacle_locations = {r["location"] for r in receptacles}
    for _attempt in range(100):
        x, z = sc["points"][int(rng.integers(len(sc["points"])))]
        start = _location(x, z, 90 * int(rng.integers(4)), 30)
        if start not in receptacle_locations:
            break

    trial = f"trial_G{GENERATOR_VERSION}_{seed}_{floor_plan}_{TASK_TYPES.index(task_type)}"
    problem = _problem(c, goal_library, trial, receptacles, named, start, task_type,
                       target_object, target_receptacle, toggle)
    pddl_params = {"mrecep_target": "", "object_sliced": False, "object_target": target_object,
                   "parent_target": target_receptacle, "toggle_target": toggle}
    templates = goal_library.gdict[task_type]["templates"]
    goal_text = templates[int(rng.integers(len(templates)))].format(
        obj=target_object.lower(), recep=target_receptacle.lower(), toggle=toggle.lower(), mrecep="")
    with open(ALFRED_PDDL_PATH) as f:
        domain = f.read()
    with open(ALFRED_TWL2_PATH) as f:
        grammar = f.read().replace("UNKNOWN GOAL", goal_text)
    traj_data = {
        "task_type": task_type,
        "task_id": trial,
        "pddl_params": pddl_params,
        "scene": {"floor_plan": f"FloorPlan{floor_plan}", "scene_num": floor_plan, "random_seed": int(seed)},
        "turk_annotations": {"anns": [{"task_desc": goal_text[:1].upper() + goal_text[1:] + ".",
                                       "high_descs": [], "votes": []}]},
        "plan": {"high_pddl": [], "low_actions": []},
        "images": [],
        "generator": f"torchrl_agent.envs.alfworld_gen {GENERATOR_VERSION}",
    }
    folder = f"{task_type}-{target_object}-None-{target_receptacle or toggle}-{floor_plan}/{trial}"
    game = {"pddl_domain": domain, "grammar": grammar, "pddl_problem": problem, "solvable": None, "walkthrough": None}
    return {"game": game, "traj_data": traj_data, "folder": folder}


def _problem(c, goal_library, trial, receptacles, objects, start, task_type, target_object, target_receptacle, toggle):
    receptacle_classes = sorted(set(c.RECEPTACLES) - set(c.MOVABLE_RECEPTACLES))
    object_classes = sorted(set(c.OBJECTS_SET) - set(receptacle_classes))
    locations = sorted({r["location"] for r in receptacles} | {start})
    object_types = sorted({otype for _, otype, _ in objects})
    lines = ["", f"(define (problem plan_{trial})", "(:domain alfred)", "(:objects", "agent1 - agent"]
    lines += [f"        {o} - object" for o in object_classes]
    lines += [f"        {o}Type - otype" for o in object_classes]
    lines += [f"        {r}Type - rtype" for r in receptacle_classes]
    lines += [""]
    lines += [f"        {mangle(i)} - object" for i, _, _ in sorted(objects)]
    lines += [f"        {mangle(r['id'])} - receptacle" for r in receptacles]
    lines += [f"        {mangle(loc)} - location" for loc in locations]
    lines += ["        )", "", "", "(:init", ""]
    init = []
    init += [f"(receptacleType {mangle(r['id'])} {r['type']}Type)" for r in receptacles]
    init += [f"(objectType {mangle(i)} {t}Type)" for i, t, _ in objects]
    for rtype in sorted({r["type"] for r in receptacles}):
        for otype in object_types:
            if otype in c.VAL_RECEPTACLE_OBJECTS.get(rtype, ()):
                init.append(f"(canContain {rtype}Type {otype}Type)")
    for i, t, _ in objects:
        name = mangle(i)
        if t not in _LAMPS:
            init.append(f"(pickupable {name})")
        else:
            init.append(f"(toggleable {name})")
        if t in c.MOVABLE_RECEPTACLES_SET:
            init.append(f"(isReceptacleObject {name})")
        for fact, group in (("cleanable", "Cleanable"), ("heatable", "Heatable"), ("coolable", "Coolable"),
                            ("sliceable", "Sliceable")):
            if t in c.VAL_ACTION_OBJECTS[group]:
                init.append(f"({fact} {name})")
    init += [f"(openable {mangle(r['id'])})" for r in receptacles if r["openable"]]
    init.append(f"(atLocation agent1 {mangle(start)})")
    init += [f"(inReceptacle {mangle(i)} {mangle(h['id'])})" for i, _, h in objects]
    init += [f"(receptacleAtLocation {mangle(r['id'])} {mangle(r['location'])})" for r in receptacles]
    init += [f"(objectAtLocation {mangle(i)} {mangle(h['location'])})" for i, _, h in objects]
    lines += [f"        {fact}" for fact in init]
    lines += ["        )", ""]
    goal = goal_library.gdict[task_type]["pddl"].format(
        obj=target_object, recep=target_receptacle, toggle=toggle, mrecep="")
    lines += [goal.replace(" # ", " - ").replace("#", "-")]
    return "\n".join(lines) + "\n"


def _expert_walkthrough(game_file: str, max_steps: int, seed: int) -> list[str] | None:
    """The hand-coded expert's winning commands on ``game_file`` (played like the env plays it), or None."""
    game = ALFWorldGame([game_file], expert=True)
    state = game.reset(2 * seed)
    commands = []
    for _ in range(max_steps):
        command = state.expert_action
        state, _reward, _terminated, won = game.step(command)
        commands.append(command)
        if won:
            return commands
    return None


def generate_games(
    out_dir: str | os.PathLike,
    *,
    split: str = "train",
    task_types: Sequence[str] = TASK_TYPES,
    games_per_type: int = 4,
    seed: int = 0,
    max_expert_steps: int = 50,
    max_attempts: int = 50,
) -> list[str]:
    """Write ``games_per_type`` expert-solved games of each task type into ``out_dir/json_2.1.1/<split>/``.

    Game ``k`` of a type is drawn from floor plans of ``split`` in a seeded order; a draw the scene
    cannot host, or that the expert does not win within ``max_expert_steps``, is skipped. Returns
    the written ``game.tw-pddl`` paths. Deterministic for ``(split, task_types, games_per_type, seed)``.
    """
    if games_per_type < 1:
        raise ValueError(f"games_per_type must be >= 1, got {games_per_type}")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    unknown = [t for t in task_types if t not in TASK_TYPES]
    if unknown:
        raise ValueError(f"task_types must be a subset of {TASK_TYPES}, got {list(task_types)!r}")
    plans = floor_plans(split)
    written = []
    split_dir = os.path.join(os.fspath(out_dir), "json_2.1.1", split)
    for t_index, task_type in enumerate(TASK_TYPES):
        if task_type not in task_types:
            continue
        order = np.random.default_rng([seed, SPLITS.index(split), t_index]).permutation(len(plans))
        kept, attempt = 0, 0
        while kept < games_per_type and attempt < max_attempts * games_per_type:
            floor_plan = plans[int(order[attempt % len(plans)])]
            game_seed = seed * 1_000_003 + attempt + (_SEEN_SEED_OFFSET if split == "valid_seen" else 0)
            attempt += 1
            built = make_game(floor_plan, task_type, game_seed)
            if built is None:
                continue
            folder = os.path.join(split_dir, built["folder"])
            os.makedirs(folder, exist_ok=True)
            game_file = os.path.join(folder, "game.tw-pddl")
            with open(os.path.join(folder, "traj_data.json"), "w") as f:
                json.dump(built["traj_data"], f, indent=2)
            with open(game_file, "w") as f:
                json.dump(built["game"], f)
            walkthrough = _expert_walkthrough(game_file, max_expert_steps, game_seed)
            if walkthrough is None:
                shutil.rmtree(folder)
                with contextlib.suppress(OSError):  # the task's folder, unless another trial of it is kept
                    os.rmdir(os.path.dirname(folder))
                continue
            built["game"].update(solvable=True, walkthrough=walkthrough)
            with open(game_file, "w") as f:
                json.dump(built["game"], f)
            written.append(game_file)
            kept += 1
        if kept < games_per_type:
            raise RuntimeError(f"could only generate {kept}/{games_per_type} {task_type} games for split {split!r}")
    return written


def default_cache_dir() -> str:
    return os.path.join(os.path.expanduser("~"), ".cache", "torchrl_agent", "alfworld_games")


def generated_data_dir(
    *,
    games_per_type: int = 4,
    seed: int = 0,
    task_types: Sequence[str] = TASK_TYPES,
    cache_dir: str | os.PathLike | None = None,
    splits: Sequence[str] = _BASE_SPLITS,
) -> str:
    """A data root holding generated games of every split in ``splits`` (of :data:`SPLITS`),
    each generated on first use and cached.

    The cache folder is ``<cache_dir>/<GENERATOR_VERSION>-alfworld<version>/seed<seed>-n<games_per_type>[-<types>]``
    (``cache_dir`` defaults to ``~/.cache/torchrl_agent/alfworld_games``). Each split is generated
    alone, into a temporary folder moved into place when complete (its marker file ``DONE-<split>``;
    ``DONE`` once ``train`` and ``valid_unseen`` are both there): a split asked for is added to an
    existing root, leaving the others as they are, and a generation killed midway keeps the splits
    it finished (its temporary folder is removed by the next one). A file lock makes concurrent
    first uses generate once.
    """
    unknown = [sp for sp in splits if sp not in SPLITS]
    if unknown:
        raise ValueError(f"splits must be a subset of {SPLITS}, got {list(splits)!r}")
    from alfworld.info import __version__ as alfworld_version

    task_types = [t for t in TASK_TYPES if t in task_types]
    name = f"seed{seed}-n{games_per_type}"
    if len(task_types) < len(TASK_TYPES):
        name += "-" + "-".join(str(TASK_TYPES.index(t) + 1) for t in task_types)
    root = os.path.join(os.fspath(cache_dir or default_cache_dir()),
                        f"{GENERATOR_VERSION}-alfworld{alfworld_version}", name)

    def done(split: str) -> bool:  # "DONE": a root written before splits had markers of their own
        return os.path.isfile(os.path.join(root, f"DONE-{split}")) or (
            split in _BASE_SPLITS and os.path.isfile(os.path.join(root, "DONE")))

    if all(done(sp) for sp in splits):
        return root
    parent = os.path.dirname(root)
    os.makedirs(parent, exist_ok=True)
    with open(root + ".lock", "w") as lock, _locked(lock):
        # under the lock nobody else generates: a temporary folder left here is a killed generation's
        for entry in os.listdir(parent):
            stale = os.path.join(parent, entry)
            if entry.startswith(os.path.basename(root) + ".") and os.path.isdir(stale):
                shutil.rmtree(stale, ignore_errors=True)
        for split in [sp for sp in SPLITS if sp in splits and not done(sp)]:
            tmp = tempfile.mkdtemp(prefix=os.path.basename(root) + ".", dir=parent)
            try:
                generate_games(tmp, split=split, task_types=task_types, games_per_type=games_per_type, seed=seed)
                target = os.path.join(root, "json_2.1.1", split)
                os.makedirs(os.path.dirname(target), exist_ok=True)
                if os.path.isdir(target):
                    shutil.rmtree(target)
                os.rename(os.path.join(tmp, "json_2.1.1", split), target)
                open(os.path.join(root, f"DONE-{split}"), "w").close()
                if all(done(sp) for sp in _BASE_SPLITS) and not os.path.isfile(os.path.join(root, "DONE")):
                    with open(os.path.join(root, "DONE"), "w") as f:
                        f.write(GENERATOR_VERSION + "\n")
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return root


@contextlib.contextmanager
def _locked(handle):
    fcntl.flock(handle, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(handle, fcntl.LOCK_UN)
