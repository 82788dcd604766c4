"""Bad data files (WebShop, Search-R1, ALFWorld, AppWorld) fail when the env is built, naming the file, record and field.

Every fault is caused for real: the bad file is written into ``tmp_path`` and the env (or its loader) reads it.
"""

from __future__ import annotations

import json
import logging
import pickle
import shutil
import sys

import pytest
from conftest import SHARED_DATA

from torchrl_agent.envs import make_env
from torchrl_agent.envs.alfworld import find_game_files
from torchrl_agent.envs.appworld import AppWorldEnv, load_project_tasks
from torchrl_agent.envs.appworld.tasks import TASKS_FILE
from torchrl_agent.envs.data_files import DataFileError, read_json
from torchrl_agent.envs.search import SearchEnv, load_searchr1_questions
from torchrl_agent.envs.webshop import SHIPPED_DATA_DIR, load_catalogue

REAL_GAME = "json_2.1.1/train/pick_heat_then_place_in_recep-Potato-None-SinkBasin-14/trial_T20190908_231731_054988"


def test_data_file_error_is_a_value_error_that_survives_pickling(tmp_path):
    err = DataFileError(tmp_path / "a.json", "must be a string, got int 3", record=4, field="name")
    assert isinstance(err, ValueError)
    assert str(err) == f"{tmp_path / 'a.json'}: record 4: field 'name': must be a string, got int 3"
    again = pickle.loads(pickle.dumps(err))  # worker processes send their errors to the parent
    assert (str(again), again.record, again.field) == (str(err), 4, "name")


def test_read_json_names_a_file_cut_short(tmp_path):
    path = tmp_path / "cut.json"
    path.write_text(json.dumps([{"a": 1}, {"b": 2}])[:12])
    with pytest.raises(DataFileError, match=r"cut\.json: not valid JSON .*line 1, column \d+.*cut short"):
        read_json(path)
    path.write_bytes(b'{"a": "\xff"}')
    with pytest.raises(DataFileError, match=r"cut\.json: not UTF-8 text"):
        read_json(path)


# ----------------------------------------------------------------------------------------------- WebShop
@pytest.fixture
def webshop_dir(tmp_path):
    """WebShop's file names (the 1000-product ones), holding the shipped small catalogue."""
    for name in ("items_shuffle", "items_ins_v2"):
        shutil.copy(SHIPPED_DATA_DIR / f"{name}_small.json", tmp_path / f"{name}_1000.json")
    load_catalogue.cache_clear()
    yield tmp_path
    load_catalogue.cache_clear()


def _webshop(data_dir):
    return make_env("webshop", data_dir=str(data_dir), num_groups=1, group_size=1, num_test_goals=5)


def test_webshop_items_file_of_the_wrong_shape_is_named(webshop_dir):
    items = webshop_dir / "items_shuffle_1000.json"
    items.write_text(json.dumps({"products": json.loads(items.read_text())}))  # an object, not a list
    with pytest.raises(DataFileError) as info:
        _webshop(webshop_dir)
    assert str(info.value).startswith(f"{items}: must be a list of products")
    assert "got an object" in str(info.value)


def test_a_bad_data_file_read_in_worker_processes_is_raised_as_is(webshop_dir):
    items = webshop_dir / "items_shuffle_1000.json"
    items.write_text(items.read_text()[:500])
    with pytest.raises(DataFileError, match=rf"^{items}: not valid JSON"):  # not a RuntimeError quoting a traceback
        make_env("webshop", data_dir=str(webshop_dir), num_workers=1, num_groups=1, group_size=2)


def test_webshop_instruction_file_of_the_wrong_shape_is_named(webshop_dir):
    attributes = webshop_dir / "items_ins_v2_1000.json"
    attributes.write_text(json.dumps(list(json.loads(attributes.read_text()).values())))  # a list, not an object
    with pytest.raises(DataFileError, match=rf"^{attributes}: must be an object of asin -> attributes"):
        _webshop(webshop_dir)


def test_webshop_truncated_file_is_named(webshop_dir):
    items = webshop_dir / "items_shuffle_1000.json"
    text = items.read_text()
    items.write_text(text[: len(text) // 2])
    with pytest.raises(DataFileError, match=rf"^{items}: not valid JSON \(.*line \d+, column \d+\).*cut short"):
        _webshop(webshop_dir)


def test_webshop_record_with_a_mistyped_field_names_record_and_field(webshop_dir):
    items = webshop_dir / "items_shuffle_1000.json"
    products = json.loads(items.read_text())
    index = next(i for i, p in enumerate(products) if p.get("customization_options"))
    name = next(iter(products[index]["customization_options"]))
    products[index]["customization_options"][name][0]["value"] = 3
    items.write_text(json.dumps(products))
    with pytest.raises(DataFileError) as info:
        _webshop(webshop_dir)
    err = info.value
    assert (err.path, err.field) == (str(items), f"customization_options.{name}[0].value")
    assert err.record == f"{index} (asin {products[index]['asin']})"
    assert str(err).endswith("must be a string, got int 3")

    products[index]["customization_options"][name][0]["value"] = "fine again"
    products[0]["pricing"] = 12.5
    items.write_text(json.dumps(products))
    load_catalogue.cache_clear()
    with pytest.raises(DataFileError, match=r"record 0 \(asin \w+\): field 'pricing': must be a string, got float"):
        _webshop(webshop_dir)


def test_webshop_instruction_with_a_mistyped_field_is_named(webshop_dir):
    attributes = webshop_dir / "items_ins_v2_1000.json"
    entries = json.loads(attributes.read_text())
    asin = next(iter(entries))
    entries[asin]["instruction_attributes"] = "long lasting"  # a string, not a list
    attributes.write_text(json.dumps(entries))
    with pytest.raises(DataFileError, match=rf"^{attributes}: record {asin}: field 'instruction_attributes': "
                                            r"must be a list, got str"):
        _webshop(webshop_dir)


def test_webshop_products_skipped_by_webshops_rule_are_counted_in_a_warning(webshop_dir, caplog):
    items = webshop_dir / "items_shuffle_1000.json"
    products = json.loads(items.read_text())
    products[4]["asin"] = "nan"  # WebShop's loader skips such rows
    items.write_text(json.dumps(products))
    with caplog.at_level(logging.WARNING):
        catalogue = load_catalogue(str(webshop_dir))
    assert len(catalogue.products) == len(products) - 1
    assert "skipped 1 products whose asin is empty, 'nan' or longer than 10 characters" in caplog.text
    assert "the first: record 4" in caplog.text


def test_webshop_valid_files_still_load(webshop_dir):
    env = _webshop(webshop_dir)
    assert len(env.catalogue.products) == len(json.loads((webshop_dir / "items_shuffle_1000.json").read_text()))


# ----------------------------------------------------------------------------------------------- Search-R1
GOOD_ROW = {"id": "nq_0", "question": "who wrote hamlet?", "golden_answers": ["Shakespeare"], "data_source": "nq"}


def _jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_searchr1_golden_answers_of_the_wrong_type_is_named_at_env_build(tmp_path):
    train = _jsonl(tmp_path / "train.jsonl", [GOOD_ROW, {"question": "how many?", "golden_answers": 3}])
    with pytest.raises(DataFileError) as info:
        SearchEnv(train_file=str(train), retriever="http://127.0.0.1:9/retrieve")  # fails before any retrieval
    assert str(info.value) == (f"{train}: record 1: field 'golden_answers': must be a list of strings or a string, "
                               "got int 3")


@pytest.mark.parametrize("row, field, problem", [
    (7, None, "must be an object, got int 7"),
    ({"question": ["q"], "golden_answers": ["a"]}, "question", "must be a string, got a list of 1"),
    ({"question": "q", "golden_answers": [{"a": 1}]}, "golden_answers", "answer 0 must be a string, got an object"),
    ({"question": "q", "reward_model": "abc"}, "reward_model", "must be an object, got str 'abc'"),
    ({"question": "q", "reward_model": {"ground_truth": {"target": 5}}}, "reward_model.ground_truth.target",
     "must be a list of strings or a string, got int 5"),
    ({"question": "q", "golden_answers": ["a"], "data_source": ["nq"]}, "data_source",
     "must be a string or an integer, got a list of 1"),
])
def test_searchr1_bad_rows_are_named(tmp_path, row, field, problem):
    path = _jsonl(tmp_path / "rows.jsonl", [GOOD_ROW, row])
    with pytest.raises(DataFileError) as info:
        load_searchr1_questions(path)
    assert (info.value.path, info.value.record, info.value.field, info.value.problem) == (str(path), 1, field, problem)


def test_searchr1_files_cut_short_are_named(tmp_path):
    pa = pytest.importorskip("pyarrow")  # installed with the search extra
    import pyarrow.parquet as pq

    jsonl = tmp_path / "cut.jsonl"
    jsonl.write_text(json.dumps(GOOD_ROW) + "\n" + json.dumps(GOOD_ROW)[:25])
    with pytest.raises(DataFileError, match=rf"^{jsonl}: line 2 is not valid JSON"):
        load_searchr1_questions(jsonl)
    array = tmp_path / "cut.json"
    array.write_text(json.dumps([GOOD_ROW, GOOD_ROW])[:40])
    with pytest.raises(DataFileError, match=rf"^{array}: not valid JSON .*cut short"):
        load_searchr1_questions(array)
    parquet = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([GOOD_ROW] * 4), parquet)
    assert len(load_searchr1_questions(parquet)) == 4
    data = parquet.read_bytes()
    parquet.write_bytes(data[: len(data) // 2])
    with pytest.raises(DataFileError, match=rf"^{parquet}: not a readable parquet file"):
        load_searchr1_questions(parquet)


def test_searchr1_rows_without_answers_are_skipped_with_a_warning_naming_the_first(tmp_path, caplog):
    path = _jsonl(tmp_path / "rows.jsonl", [GOOD_ROW, {"question": "no answers"}, {"golden_answers": ["x"]}])
    with caplog.at_level(logging.WARNING):
        questions = load_searchr1_questions(path)
    assert [q.id for q in questions] == ["nq_0"]
    assert "skipped 2 rows without a question or golden answers (the first: row 1)" in caplog.text


# ----------------------------------------------------------------------------------------------- ALFWorld
@pytest.fixture
def alfworld_dir(tmp_path):
    """A writable copy of the real ALFWorld game in ALFWorld's layout."""
    source = SHARED_DATA / "alfworld" / REAL_GAME
    if not source.is_dir():
        pytest.fail(f"the real ALFWorld game is missing: {source}")
    shutil.copytree(source, tmp_path / REAL_GAME)
    return tmp_path


def test_alfworld_truncated_game_file_is_named(alfworld_dir):
    game = alfworld_dir / REAL_GAME / "game.tw-pddl"
    assert find_game_files(str(alfworld_dir)) == [str(game)]
    text = game.read_text()
    game.write_text(text[: len(text) * 2 // 3])
    with pytest.raises(DataFileError, match=rf"^{game}: not valid JSON .*cut short"):
        find_game_files(str(alfworld_dir))


@pytest.mark.parametrize("edit, field, problem", [
    (lambda g: g.pop("pddl_problem"), "pddl_problem", "is missing"),
    (lambda g: g.update(grammar=["not", "text"]), "grammar", "must be a string, got a list of 2"),
    (lambda g: g.update(solvable="yes"), "solvable", "must be true or false, got str 'yes'"),
])
def test_alfworld_game_file_with_a_bad_field_is_named(alfworld_dir, edit, field, problem):
    game = alfworld_dir / REAL_GAME / "game.tw-pddl"
    content = json.loads(game.read_text())
    edit(content)
    game.write_text(json.dumps(content))
    with pytest.raises(DataFileError) as info:
        find_game_files(str(alfworld_dir))
    assert (info.value.path, info.value.field) == (str(game), field)
    assert info.value.problem.startswith(problem)


def test_alfworld_garbled_traj_data_is_named(alfworld_dir):
    """A game folder not named after its task type: the type is read from traj_data.json."""
    trial = alfworld_dir / REAL_GAME
    renamed = alfworld_dir / "json_2.1.1" / "train" / "some-game" / trial.name
    renamed.parent.mkdir()
    trial.rename(renamed)
    assert find_game_files(str(alfworld_dir)) == [str(renamed / "game.tw-pddl")]
    traj = renamed / "traj_data.json"
    traj.write_text('{"task_type": ')
    with pytest.raises(DataFileError, match=rf"^{traj}: not valid JSON"):
        find_game_files(str(alfworld_dir))
    traj.write_text(json.dumps({"task_id": "x"}))
    with pytest.raises(DataFileError, match=rf"^{traj}: field 'task_type': is missing"):
        find_game_files(str(alfworld_dir))


def test_alfworld_missing_game_file_is_warned_and_the_env_says_no_game(alfworld_dir, caplog):
    game = alfworld_dir / REAL_GAME / "game.tw-pddl"
    game.unlink()
    with caplog.at_level(logging.WARNING):
        assert find_game_files(str(alfworld_dir)) == []
    assert f"skipped 1 game folders that miss a file (as ALFWorld does); the first lacks {game}" in caplog.text
    pytest.importorskip("alfworld", reason="needs the 'alfworld' extra")  # installed in CI: never skipped there
    with pytest.raises(ValueError, match="no ALFWorld game found for split 'train'"):
        make_env("alfworld", data_dir=str(alfworld_dir), num_groups=1, group_size=1)


def test_alfworld_env_names_a_garbled_game_at_build(alfworld_dir):
    pytest.importorskip("alfworld", reason="needs the 'alfworld' extra")  # installed in CI: never skipped there
    game = alfworld_dir / REAL_GAME / "game.tw-pddl"
    game.write_text(game.read_text()[:1000])
    with pytest.raises(DataFileError, match=rf"^{game}: not valid JSON"):
        make_env("alfworld", data_dir=str(alfworld_dir), num_groups=1, group_size=1)
    with pytest.raises(DataFileError, match=rf"^{game}: not valid JSON"):
        make_env("alfworld", game_files=[str(game)], num_groups=1, group_size=1)


# ----------------------------------------------------------------------------------------------- AppWorld
def _project_tasks(tmp_path, edit):
    content = json.loads(TASKS_FILE.read_text())
    edit(content["tasks"])
    path = tmp_path / "tasks.json"
    path.write_text(json.dumps(content))
    return path


@pytest.mark.parametrize("edit, record, field, problem", [
    (lambda tasks: tasks[2].pop("instruction"), "2 (id {id2})", "instruction", "is missing"),
    (lambda tasks: tasks[1].update(split="dev"), "1 (id {id1})", "split", "must be 'train' or 'test', got 'dev'"),
    (lambda tasks: tasks[0].update(datetime="yesterday"), "0 (id {id0})", "datetime",
     "must be an ISO date and time, got 'yesterday'"),
    (lambda tasks: tasks[0]["supervisor"].pop("email"), "0 (id {id0})", "supervisor.email", "must be a string, got null"),
    (lambda tasks: tasks[3].update(id=tasks[0]["id"]), 3, "id", "'{id0}' is also the id of record 0"),
    (lambda tasks: tasks.__setitem__(4, "a task"), 4, None, "must be an object, got str 'a task'"),
])
def test_appworld_project_tasks_with_a_bad_field_are_named(tmp_path, edit, record, field, problem):
    ids = {f"id{i}": t["id"] for i, t in enumerate(load_project_tasks())}
    path = _project_tasks(tmp_path, edit)
    with pytest.raises(DataFileError) as info:
        load_project_tasks(path)
    record = record.format(**ids) if isinstance(record, str) else record
    assert (info.value.path, info.value.record, info.value.field) == (str(path), record, field)
    assert info.value.problem == problem.format(**ids)


def test_appworld_data_dir_with_a_garbled_task_is_named_at_env_build(tmp_path):
    specs = tmp_path / "data" / "tasks" / "abc_1" / "specs.json"
    specs.parent.mkdir(parents=True)
    specs.write_text('{"instruction": "Play my playlist", "datetime": ')  # cut short
    # python=: any existing interpreter; no AppWorld worker starts before the first reset
    with pytest.raises(DataFileError, match=rf"^{specs}: not valid JSON"):
        AppWorldEnv(data_dir=str(tmp_path), task_ids=["abc_1"], python=sys.executable)
    specs.write_text(json.dumps({"instruction": "Play my playlist", "datetime": "2023-05-18T12:00:00",
                                 "db_version": "0.1.0"}))
    with pytest.raises(DataFileError, match=rf"^{specs}: field 'main_user': must be an object, got null"):
        AppWorldEnv(data_dir=str(tmp_path), task_ids=["abc_1"], python=sys.executable)
    with pytest.raises(FileNotFoundError, match=r"task 'abc_2' has no .*abc_2/specs\.json"):
        AppWorldEnv(data_dir=str(tmp_path), task_ids=["abc_2"], python=sys.executable)
    with pytest.raises(FileNotFoundError, match=r"dataset 'train' has no file .*datasets/train\.txt"):
        AppWorldEnv(data_dir=str(tmp_path), python=sys.executable)


# ----------------------------------------------------------------------------------------------- the CLI
def test_cli_reports_a_bad_data_file_in_one_line_with_exit_2(webshop_dir, capsys):
    from torchrl_agent.trainers.cli import main

    items = webshop_dir / "items_shuffle_1000.json"
    items.write_text(items.read_text()[:300])
    assert main(["train", "experiment=smoke", "env.name=webshop", f"+env.kwargs.data_dir={webshop_dir}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"torchrl-agent: invalid config: {items}: not valid JSON"), err


def test_cli_reports_a_bad_evaluation_data_file_in_one_line_with_exit_2(alfworld_dir, tmp_path, capsys):
    """The evaluation env is built at the first evaluation (iteration 0, before any training)."""
    pytest.importorskip("alfworld", reason="needs the 'alfworld' extra")  # installed in CI: never skipped there
    from torchrl_agent.trainers.cli import main

    valid = alfworld_dir / REAL_GAME.replace("/train/", "/valid_unseen/")
    shutil.copytree(alfworld_dir / REAL_GAME, valid)
    game = valid / "game.tw-pddl"
    game.write_text(game.read_text()[:2000])
    assert main(["train", "experiment=smoke", "env.name=alfworld", f"+env.kwargs.data_dir={alfworld_dir}",
                 f"run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"torchrl-agent: invalid config: {game}: not valid JSON"), err


def test_cli_reports_a_missing_evaluation_split_as_an_invalid_config(alfworld_dir, tmp_path, capsys):
    """No ``valid_unseen`` games beside the training games: exit 2 naming it, not a disk-fault hint."""
    pytest.importorskip("alfworld", reason="needs the 'alfworld' extra")  # installed in CI: never skipped there
    from torchrl_agent.trainers.cli import main

    assert main(["train", "experiment=smoke", "env.name=alfworld", f"+env.kwargs.data_dir={alfworld_dir}",
                 f"run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("torchrl-agent: invalid config: "), err
    assert "valid_unseen" in err[-1] and "free space" not in err[-1], err


def test_alfworld_unsolvable_games_are_counted_in_the_log(alfworld_dir, caplog):
    game = alfworld_dir / REAL_GAME / "game.tw-pddl"
    content = json.loads(game.read_text())
    content["solvable"] = False
    game.write_text(json.dumps(content))
    with caplog.at_level(logging.INFO, logger="torchrl_agent.envs.alfworld.files"):
        assert find_game_files(str(alfworld_dir)) == []
    assert f"skipped 1 games not marked solvable (as ALFWorld does); the first: {game}" in caplog.text
