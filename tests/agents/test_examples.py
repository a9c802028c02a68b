"""The example environments, tools, rows and demonstrations (agents/examples.py): each environment end to end
through `Agent` with scripted assistant messages (a right episode scores 1, a wrong or tool-less one 0), the
treasure hunt's and the guessing game's feedback metrics telling a policy that reads the replies from one that does
not, determinism by seed in any process, disjoint splits, demonstrations that replay against a fresh environment
and render through SmolLM2's ChatFormat with the assistant's turns masked in, and TRL 1.16's own handling of
environments (its tool listing, its tool calls, its reward computation) giving what ours gives."""

from __future__ import annotations

import inspect
import json
import math
import random
import subprocess
import sys
import types

import pytest

from tpu_helpers.agents import Agent, ChatFormat, load_environment
from tpu_helpers.agents.examples import (
    SEED_RANGES,
    SYSTEM,
    GuessingGame,
    Lockers,
    TreasureHunt,
    call,
    feedback_use,
    final_answer,
    guess_budget,
    guessing_demonstrations,
    guessing_rows,
    hunt_boxes,
    hunt_demonstrations,
    hunt_reward,
    hunt_rows,
    locker_codes,
    locker_demonstrations,
    locker_reward,
    locker_rows,
    multiply,
    multiply_demonstrations,
    multiply_rows,
    multiply_split,
    note_following,
    product_reward,
)


def say(text: str) -> dict:
    return {"role": "assistant", "content": text}


def lockers_agent() -> Agent:
    return Agent(environment_factory=Lockers, reward_funcs=[locker_reward])


def hunt_agent() -> Agent:
    return Agent(environment_factory=TreasureHunt, reward_funcs=[hunt_reward, note_following])


def guessing_agent() -> Agent:
    return Agent(environment_factory=GuessingGame, reward_funcs=[feedback_use])


def multiply_agent() -> Agent:
    return Agent(tools=[multiply], reward_funcs=[product_reward])


def test_lockers_rewards_only_the_code_read_from_the_environment():
    agent = lockers_agent()
    row = locker_rows(1, seed=3)[0]
    code = locker_codes(row["seed"])[row["locker"]]
    others = [c for name, c in locker_codes(row["seed"]).items() if name != row["locker"]]

    right = agent.start(row)
    assert right.prompt[0] == {"role": "system", "content": SYSTEM}
    assert right.prompt[1]["content"] == (f"What is the code of the {row['locker']} locker? Lockers: "
                                          + ", ".join(locker_codes(row["seed"])) + ".")
    assert right.answer(call("open_locker", name=row["locker"].upper())) == [
        {"role": "tool", "name": "open_locker", "content": str(code)}]
    assert right.answer(say(f"The code is {code:,}.")) == []  # commas between digits are one number

    wrong = agent.start(row)
    wrong.answer(call("open_locker", name="purple"))
    assert wrong.completion[-1]["content"] == "no such locker"
    wrong.answer(say(str(others[0])))
    no_tool = agent.start(row)
    no_tool.answer(say("1234"))
    every_code = agent.start(row)
    every_code.answer(say(" ".join(str(c) for c in locker_codes(row["seed"]).values())))
    mid_call = agent.start(row)
    mid_call.answer({**call("open_locker", name=row["locker"]), "content": str(code)})  # cut after a call
    assert agent.rewards([right, wrong, no_tool, every_code, mid_call]) == {
        "locker_reward": [1.0, 0.0, 0.0, 0.0, 0.0]}
    assert right.environment.opened == [row["locker"]]


def test_the_treasure_hunt_rewards_only_the_code_its_note_leads_to_and_measures_following_the_note():
    agent = hunt_agent()
    rows = hunt_rows(30, seed=2)
    for row in rows:
        codes, target = hunt_boxes(row["seed"])
        assert row["start"] in codes and row["start"] != target
    row = rows[0]
    codes, target = hunt_boxes(row["seed"])
    others = [name for name in codes if name not in (row["start"], target)]
    assert len(others) == 2

    follows = agent.start(row)
    assert follows.prompt[1]["content"] == (f"Find the code. Start at the {row['start']} box. Boxes: "
                                            + ", ".join(codes) + ".")
    assert follows.answer(call("open_box", name=row["start"].title()))[0]["content"] == f"go to the {target} box"
    assert follows.answer(call("open_box", name=target))[0]["content"] == str(codes[target])
    follows.answer(say(str(codes[target])))
    ignores = agent.start(row)  # reads the note, opens another box, answers its (wrong) code
    ignores.answer(call("open_box", name=row["start"]))
    ignores.answer(call("open_box", name=others[0]))
    ignores.answer(say(ignores.completion[-1]["content"]))
    stops = agent.start(row)  # reads the note, then answers without opening the box
    stops.answer(call("open_box", name=row["start"]))
    stops.answer(say("1234"))
    skips = agent.start(row)  # opens the right box at once: the right code without the note (no feedback to use)
    skips.answer(call("open_box", name=target))
    skips.answer(say(str(codes[target])))
    nothing = agent.start(row)
    nothing.answer(say(str(codes[target])))
    cut = agent.start(row)  # the episode ends right after the note
    cut.answer(call("open_box", name=row["start"]))
    rewards = agent.rewards([follows, ignores, stops, skips, nothing, cut])
    assert rewards["hunt_reward"] == [1.0, 0.0, 0.0, 1.0, 1.0, 0.0]
    assert rewards["note_following"][:3] == [1.0, 0.0, 0.0] and rewards["note_following"][5] == 0.0
    assert all(math.isnan(v) for v in rewards["note_following"][3:5])
    assert follows.environment.opened == [row["start"], target] and follows.environment.code == codes[target]
    assert ignores.environment.open_box("purple") == "no such box"
    hunt = TreasureHunt()
    hunt.reset(seed=row["seed"], start=f" {row['start'].upper()}")  # names as open_box takes them
    assert hunt.start == row["start"] and hunt.target == target
    with pytest.raises(ValueError, match=f"starts at box '{target}'"):
        hunt.reset(seed=row["seed"] + 1, start=target)
    assert hunt.codes == codes and hunt.target == target  # a refused reset leaves the episode as it was

    # The call after the note, however it is written: arguments as a JSON string (as datasets hold them), a call
    # that is not a mapping (skipped, never a crash), several calls (the first open_box decides).
    note = [call("open_box", name=row["start"]),
            {"role": "tool", "name": "open_box", "content": f"go to the {target} box"}]
    as_string = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "open_box", "arguments": json.dumps({"name": target})}}]}
    odd = {"role": "assistant", "content": "", "tool_calls": ["open_box", {"function": None},
                                                               call("open_box", name=target)["tool_calls"][0]]}
    several = {"role": "assistant", "content": "", "tool_calls": [
        *call("open_box", name=others[0])["tool_calls"], *call("open_box", name=target)["tool_calls"]]}
    assert note_following([note + [as_string], note + [odd], note + [several]]) == [1.0, 1.0, 0.0]
    assert feedback_use([[odd, {"role": "tool", "name": "guess", "content": "higher"}]]) == [None]


def test_hunt_demonstrations_may_skip_the_note_in_a_share_of_rows():
    clean, mixed = hunt_demonstrations(200, seed=1), hunt_demonstrations(200, seed=1, skip_note=0.5)
    assert hunt_demonstrations(200, seed=1, skip_note=0.5) == mixed  # drawn per row, deterministic
    rows = hunt_rows(200, seed=1)
    skipped = 0
    for demo, plain, row in zip(mixed, clean, rows, strict=True):
        first = demo["messages"][2]["tool_calls"][0]["function"]["arguments"]["name"]
        if first == row["start"]:
            assert demo == plain  # the note read and followed, as the clean demonstration does
            continue
        skipped += 1
        codes, _ = hunt_boxes(row["seed"])
        assert [m["role"] for m in demo["messages"][2:]] == ["assistant", "tool", "assistant"]
        assert demo["messages"][-1]["content"] == str(codes[first])  # the code of the box it opened
    assert 80 <= skipped <= 120
    assert note_following([d["messages"] for d in mixed]).count(None) == skipped
    assert all(d["messages"][2]["tool_calls"][0]["function"]["arguments"]["name"] != r["start"]
               for d, r in zip(hunt_demonstrations(20, seed=1, skip_note=1.0), hunt_rows(20, seed=1), strict=True))
    with pytest.raises(ValueError, match=r"skip_note=1.5; give a share in \[0, 1\]"):
        hunt_demonstrations(1, skip_note=1.5)


def test_final_answer_is_the_one_number_of_the_last_assistant_message():
    assert final_answer([say("x"), {"role": "tool", "name": "t", "content": "5"}, say("It is 287,663.")]) == 287663
    assert final_answer([say("-12")]) == -12
    assert final_answer([say("3 and 4")]) is None and final_answer([say("no idea")]) is None
    assert final_answer([say("7, so 7")]) == 7  # one number, written twice
    assert final_answer([]) is None and final_answer([call("guess", number=3)]) is None


def binary_search(agent: Agent, row: dict):
    episode = agent.start(row)
    lo, hi = 1, row["n"]
    while True:
        guess = (lo + hi) // 2
        reply = episode.answer(call("guess", number=guess))[0]["content"]
        if reply == "correct":
            episode.answer(say(str(guess)))
            return episode
        lo, hi = (guess + 1, hi) if reply == "higher" else (lo, guess - 1)


def random_guesses(agent: Agent, row: dict, rng: random.Random, limit: int = 12):
    episode = agent.start(row)
    for _ in range(limit):
        if episode.answer(call("guess", number=rng.randint(1, row["n"])))[0]["content"] == "correct":
            break
    episode.answer(say("done"))
    return episode


def test_the_guessing_game_rewards_solving_in_few_guesses_and_feedback_use_tells_binary_search_from_random():
    agent = guessing_agent()
    rows = guessing_rows(40, seed=1)
    assert {r["n"] for r in rows} == {16, 32} and guess_budget(16) == 5 and guess_budget(32) == 6
    searched = [binary_search(agent, r) for r in rows]
    rewards = agent.rewards(searched)
    assert rewards["GuessingGame"] == [1.0] * 40  # within binary search's worst case, always
    used = [v for v in rewards["feedback_use"] if not math.isnan(v)]  # NaN: solved at the first guess
    assert used == [1.0] * len(used) and len(used) >= 35

    rng = random.Random(0)
    guessed = [random_guesses(agent, r, rng) for r in rows]
    rewards = agent.rewards(guessed)
    used = [v for v in rewards["feedback_use"] if not math.isnan(v)]
    assert sum(used) / len(used) < 0.75, used
    assert sum(rewards["GuessingGame"]) < 30


def test_guessing_game_replies_and_reward_shape():
    agent = guessing_agent()
    row = {"prompt": "Guess my number from 1 to 16.", "seed": 5, "n": 16}
    episode = agent.start(row)
    secret = episode.environment.secret
    assert episode.prompt == [{"role": "user", "content": "Guess my number from 1 to 16."}]  # reset adds nothing
    replies = [episode.answer(call("guess", number=x))[0]["content"] for x in (0, 17, "seven", str(secret))]
    assert replies == ["out of range 1-16", "out of range 1-16", "not a number", "correct"]
    env = episode.environment
    assert env.solved_at == 4 and env.get_reward() == 1.0
    env.guesses, env.solved_at = [1] * 7, 7  # two past the budget of 5
    assert env.get_reward() == pytest.approx(0.8)
    env.solved_at = 40
    assert env.get_reward() == pytest.approx(0.1)  # solved beats unsolved
    env.solved_at = None
    assert env.get_reward() == 0.0
    env.reset(seed=5, n=16, prompt="again")  # TRL reuses instances: reset rebuilds everything
    assert env.guesses == [] and env.solved_at is None and env.secret == secret


def test_feedback_use_checks_guesses_against_the_replies_seen_before_their_turn():
    def turn(*numbers):
        return {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "guess", "arguments": {"number": x}}} for x in numbers]}

    def replies(*texts):
        return [{"role": "tool", "name": "guess", "content": t} for t in texts]

    consistent = [turn(8), *replies("higher"), turn(12), *replies("lower"), turn(10), *replies("correct"), say("10")]
    ignores = [turn(8), *replies("higher"), turn(3), *replies("higher"), turn(9), *replies("correct")]
    # one turn of two guesses: the second cannot use the first's reply; the third turn must use both
    parallel = [turn(8, 4), *replies("higher", "higher"), turn(6), *replies("higher")]
    after_correct = [turn(5), *replies("correct"), turn(6), *replies("higher")]
    out_of_range = [turn(8), *replies("lower"), turn(20), *replies("out of range 1-16")]
    one = [turn(5), *replies("correct"), say("5")]
    values = feedback_use([consistent, ignores, parallel, after_correct, out_of_range, one, []],
                          n=[16, 16, 16, 16, 16, 16, 16])
    assert values[:5] == [1.0, 0.5, 0.5, 0.0, 0.0] and values[5] is None and values[6] is None
    assert feedback_use([out_of_range])[0] == 0.0  # without n: 20 is above 8 after "lower" anyway


def test_multiply_rewards_the_product():
    agent = multiply_agent()
    row = multiply_rows(1, seed=2)[0]
    assert row["answer"] == str(row["a"] * row["b"])
    assert row["prompt"][1]["content"] == f"What is {row['a']} times {row['b']}?"
    right = agent.start(row)
    assert right.answer(call("multiply", a=row["a"], b=row["b"]))[0]["content"] == row["answer"]
    right.answer(say(row["answer"]))
    wrong = agent.start(row)
    wrong.answer(say(str(int(row["answer"]) + 1)))
    assert agent.rewards([right, wrong]) == {"product_reward": [1.0, 0.0]}
    fixed = {"prompt": "What is 347 times 829?", "answer": "287663"}
    episode = agent.start(fixed)
    episode.answer(call("multiply", a=347, b=829))
    episode.answer(say("287663"))
    assert episode.completion[1]["content"] == "287663" and agent.rewards([episode])["product_reward"] == [1.0]


def test_rows_are_deterministic_by_seed_in_any_process_and_splits_are_disjoint():
    makers = (locker_rows, hunt_rows, guessing_rows, multiply_rows)
    for make in makers:
        assert make(20, seed=4) == make(20, seed=4) != make(20, seed=5)
        assert make(20, seed=4, split="test") != make(20, seed=4)
        with pytest.raises(ValueError, match=r"split='val'; give one of \['test', 'train'\]"):
            make(1, split="val")
    for make in (locker_rows, hunt_rows, guessing_rows):
        train = {r["seed"] for s in range(3) for r in make(300, seed=s)}
        test = {r["seed"] for s in range(3) for r in make(300, seed=s, split="test")}
        assert not train & test and len(train) > 800
        assert all(SEED_RANGES["test"][0] <= x < SEED_RANGES["test"][1] for x in test)
    train = {(r["a"], r["b"]) for s in range(3) for r in multiply_rows(300, seed=s)}
    test = {(r["a"], r["b"]) for s in range(3) for r in multiply_rows(300, seed=s, split="test")}
    assert not train & test and not {(b, a) for a, b in train} & test  # the order of the operands matters not
    assert all(multiply_split(a, b) == "test" for a, b in test)
    assert len({(r["a"], r["b"]) for r in multiply_rows(500)}) == 500  # distinct within a split

    # String seeds: the same episodes in another process, whatever its hash seed
    script = ("import json; from tpu_helpers.agents.examples import *; "
              "print(json.dumps([locker_rows(3), guessing_rows(3), multiply_rows(3), hunt_rows(3), locker_codes(7), "
              "hunt_boxes(7)]))")
    outs = []
    for hash_seed in ("1", "2"):
        env = {"PYTHONHASHSEED": hash_seed, "PATH": "/usr/bin:/bin"}
        outs.append(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                                   check=True).stdout)
    assert outs[0] == outs[1]
    assert json.loads(outs[0])[:4] == json.loads(json.dumps([locker_rows(3), guessing_rows(3), multiply_rows(3),
                                                             hunt_rows(3)]))
    secrets = []
    for _ in range(2):
        game = GuessingGame()
        game.reset(**guessing_rows(1, seed=9)[0])
        secrets.append(game.secret)
    assert secrets[0] == secrets[1]


def test_the_examples_import_without_torch_and_load_as_environment_values():
    out = subprocess.run([sys.executable, "-c", "import sys, tpu_helpers.agents.examples; "
                          "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy')))"],
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    assert load_environment("tpu_helpers.agents.examples:Lockers") is Lockers
    assert load_environment("tpu_helpers.agents.examples:GuessingGame") is GuessingGame
    assert load_environment("tpu_helpers.agents.examples:TreasureHunt") is TreasureHunt


DEMOS = {"lockers": (locker_demonstrations, locker_rows, lockers_agent),
         "hunt": (hunt_demonstrations, hunt_rows, hunt_agent),
         "guessing": (guessing_demonstrations, guessing_rows, guessing_agent),
         "multiply": (multiply_demonstrations, multiply_rows, multiply_agent)}


@pytest.mark.parametrize("name", list(DEMOS))
def test_demonstrations_replay_against_a_fresh_environment(name):
    demonstrations, rows, make_agent = DEMOS[name]
    demos, rows = demonstrations(12, seed=7), rows(12, seed=7)
    assert demonstrations(12, seed=7) == demos  # deterministic
    agent = make_agent()
    episodes = []
    for demo, row in zip(demos, rows, strict=True):
        assert set(demo) == {"messages", "tools"}
        episode = agent.start(row)
        n = len(episode.prompt)
        assert demo["messages"][:n] == episode.prompt and demo["tools"] == episode.schemas == agent.schemas(row)
        rest = demo["messages"][n:]
        for i, message in enumerate(rest):
            if message["role"] != "assistant":
                continue
            replies = episode.answer(message)
            assert replies == rest[i + 1:i + 1 + len(replies)]  # the environment's own results, as recorded
            for call_ in message.get("tool_calls") or ():
                assert set(call_) == {"type", "function"} and call_["type"] == "function"
                assert isinstance(call_["function"]["arguments"], dict)
        assert episode.messages == demo["messages"] and episode.stats.failed == 0
        episodes.append(episode)
    rewards = agent.rewards(episodes)
    main = {"lockers": "locker_reward", "hunt": "hunt_reward", "guessing": "GuessingGame",
            "multiply": "product_reward"}[name]
    assert rewards[main] == [1.0] * 12
    if name == "hunt":  # two calls, the second where the first one's note said
        assert rewards["note_following"] == [1.0] * 12
        assert all(len(e.environment.opened) == 2 for e in episodes)


@pytest.fixture(scope="module")
def smollm2_format():
    from transformers import AutoTokenizer

    from tpu_helpers.models import smollm2

    target = smollm2.default_cache_dir() / smollm2.DIR_NAME
    if not smollm2.is_complete(target):
        pytest.skip("SmolLM2 is not built in the package cache (models/smollm2.py)")
    return ChatFormat(AutoTokenizer.from_pretrained(target))


@pytest.mark.parametrize("name", list(DEMOS))
def test_demonstrations_render_through_smollm2_with_the_assistant_turns_masked_in(name, smollm2_format):
    fmt = smollm2_format
    demonstrations, rows, make_agent = DEMOS[name]
    agent = make_agent()
    for demo, row in zip(demonstrations(6, seed=2), rows(6, seed=2), strict=True):
        rendered = fmt.render(demo["messages"], demo["tools"])
        assert len(rendered.ids) == len(rendered.mask) < 520
        # the prompt an RL episode generates from is the demonstration's start
        prompt = fmt.prompt_ids(agent.start(row).prompt, demo["tools"])
        assert rendered.ids[:len(prompt)] == prompt and not any(rendered.mask[:len(prompt)])
        own = [text for text, mine in rendered.pieces if mine]
        assistants = [m for m in demo["messages"] if m["role"] == "assistant"]
        assert len(own) == len(assistants)
        for text, message in zip(own, assistants, strict=True):
            assert len(fmt._ids(text)) <= 40  # a turn of a few dozen tokens at most
            if message.get("tool_calls"):
                function = message["tool_calls"][0]["function"]
                assert text.startswith("<tool_call>\n") and f'"name": "{function["name"]}"' in text
            else:
                assert text == message["content"] + fmt.end
        masked = fmt.tokenizer.decode([t for t, k in zip(rendered.ids, rendered.mask, strict=True) if k])
        assert "<tool_response>" not in masked and SYSTEM not in masked
        for m in demo["messages"]:
            if m["role"] == "tool":
                assert len(fmt._ids(m["content"])) <= 7  # terse tool results
        parsed = [fmt.parse(fmt._ids(text), tools=demo["tools"]).message for text in own]
        assert parsed == [{**m, "content": m["content"]} for m in assistants]  # the model's text parses back


# ---- TRL 1.16's own handling of environments -----------------------------------------------------------------------
def trl_environment_tools(environment) -> list:
    """The environment's tools as GRPOTrainer lists them for each rollout (its code, copied; the test below holds
    this copy to TRL's source)."""
    return [
        getattr(environment, member_name)
        for member_name, _ in inspect.getmembers(type(environment), predicate=inspect.isfunction)
        if member_name not in ("reset", "get_reward") and not member_name.startswith("_")
    ]


def test_trls_tool_listing_and_tool_calls_give_ours():
    trl = pytest.importorskip("trl")
    from transformers.utils import get_json_schema

    source = inspect.getsource(trl.GRPOTrainer)
    assert "inspect.getmembers(type(environment), predicate=inspect.isfunction)" in source
    assert 'if member_name not in ("reset", "get_reward") and not member_name.startswith("_")' in source
    assert "sync_tool_dict[tool.__name__] = tool" in source
    assert 'sync_tool_dict[name](**function["arguments"])' in source
    assert "content = result if isinstance(result, list) else str(result)" in source

    for demonstrations, rows, make_agent in DEMOS.values():
        agent = make_agent()
        for demo, row in zip(demonstrations(4, seed=3), rows(4, seed=3), strict=True):
            ours = agent.start(row)
            environment = type(ours.environment)() if ours.environment is not None else None
            if environment is not None:
                environment.reset(**row)  # TRL passes the whole row, prompt included
            tools = agent.tools + (trl_environment_tools(environment) if environment is not None else [])
            by_name = {tool.__name__: tool for tool in tools}
            # TRL renders tools=[callables]: transformers' get_json_schema of each, ours exactly
            assert [get_json_schema(t) for t in tools] == ours.schemas == demo["tools"]
            assert list(by_name) == [s["function"]["name"] for s in ours.schemas]
            messages = demo["messages"]
            for i, m in enumerate(messages):
                if m["role"] == "tool":
                    function = messages[i - 1]["tool_calls"][0]["function"]
                    result = by_name[function["name"]](**function["arguments"])
                    assert {"role": "tool", "name": function["name"], "content": str(result)} == m


def test_trls_reward_computation_gives_ours():
    pytest.importorskip("trl")
    import torch
    from trl import GRPOTrainer

    rows = guessing_rows(6, seed=4)
    agent = guessing_agent()
    rng = random.Random(1)
    episodes = [binary_search(agent, r) if i % 2 else random_guesses(agent, r, rng, limit=3)
                for i, r in enumerate(rows)]

    def get_reward(environments, _env_type=GuessingGame, **kwargs):  # TRL's wrapper of an environment's reward
        return [e.get_reward() if type(e) is _env_type else None for e in environments]

    lockers = lockers_agent()
    locker_episodes = []
    for i, row in enumerate(locker_rows(4, seed=4)):
        e = lockers.start(row)
        e.answer(call("open_locker", name=row["locker"]))
        e.answer(say(e.completion[-1]["content"] if i % 2 else "0000"))
        locker_episodes.append(e)

    hunt = hunt_agent()
    hunt_episodes = []
    for i, row in enumerate(hunt_rows(6, seed=4)):  # follows the note, opens another box, or stops at the note
        e = hunt.start(row)
        note = e.answer(call("open_box", name=row["start"]))[0]["content"].split()[-2]
        if i % 3 < 2:
            other = next(n for n in hunt_boxes(row["seed"])[0] if n not in (row["start"], note))
            e.answer(call("open_box", name=note if i % 3 == 0 else other))
        e.answer(say(e.completion[-1]["content"]))
        hunt_episodes.append(e)

    fn = getattr(GRPOTrainer._calculate_rewards, "__wrapped__", GRPOTrainer._calculate_rewards)
    for agent_, episodes_, funcs in ((agent, episodes, [feedback_use, get_reward]),
                                     (hunt, hunt_episodes, [hunt_reward, note_following]),
                                     (lockers, locker_episodes, [locker_reward])):
        stand_in = types.SimpleNamespace(
            accelerator=types.SimpleNamespace(device="cpu", is_main_process=True), reward_funcs=funcs,
            reward_processing_classes=[None] * len(funcs), reward_func_names=[f.__name__ for f in funcs],
            state=types.SimpleNamespace(global_step=0), _log_completion_extra=lambda *a: None,
            _log_metric=lambda *a: None, environments=[e.environment for e in episodes_],
            args=types.SimpleNamespace(report_to=[]))
        theirs = fn(stand_in, [e.row for e in episodes_], [e.prompt for e in episodes_],
                    [e.completion for e in episodes_], [[1]] * len(episodes_))
        ours = torch.tensor(list(agent_.rewards(episodes_).values()), dtype=torch.float32).T
        assert torch.equal(theirs.isnan(), ours.isnan())
        assert torch.equal(theirs.nan_to_num(-1), ours.nan_to_num(-1))
    assert ours[:, 0].tolist() == [0.0, 1.0, 0.0, 1.0]


def test_mul3_demonstrations_call_python_and_answer_what_it_printed():
    from tpu_helpers.agents.examples import mul3_demonstrations, mul3_reward, mul3_rows
    from tpu_helpers.agents.sandbox import python

    rows = mul3_rows(6, seed=3)
    assert rows == mul3_rows(6, seed=3) and all(100 <= r["a"] < 1000 and 100 <= r["b"] < 1000 for r in rows)
    train = {(r["a"], r["b"]) for r in mul3_rows(400, seed=1)}
    assert not train & {(r["a"], r["b"]) for r in mul3_rows(400, seed=1, split="test")}
    demos = mul3_demonstrations(6, seed=3)
    agent = Agent(tools=[python], reward_funcs=[mul3_reward])
    episodes = []
    for demo, row in zip(demos, rows, strict=True):
        assert demo["tools"] == agent.schemas(row)
        prompt, (calling, reply, final) = demo["messages"][:2], demo["messages"][2:]
        code = calling["tool_calls"][0]["function"]["arguments"]["code"]
        assert code == f"print({row['a']} * {row['b']})"
        assert reply == {"role": "tool", "name": "python", "content": row["answer"]}  # the sandbox's own result
        assert final == {"role": "assistant", "content": row["answer"]}
        episode = agent.start(row)
        assert episode.prompt == prompt
        assert episode.answer(calling) == [reply]
        episode.answer(final)
        episodes.append(episode)
    assert agent.rewards(episodes)["mul3_reward"] == [1.0] * 6
    wrong = agent.start(rows[0])
    wrong.answer({"role": "assistant", "content": str(int(rows[0]["answer"]) + 1)})
    assert agent.rewards([wrong])["mul3_reward"] == [0.0]
