"""Config loading: defaults, YAML files, `a.b=value` overrides, and errors that name the key path."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from rollout.config import Config, config_from_dict, dump_config, load_config
from rollout.config_files import packaged_config_names
from rollout.errors import InvalidConfigError
from rollout.types import Sampling

REPO = Path(__file__).resolve().parents[1]


def test_defaults_without_a_file():
    # Tuning numbers (engine count, in-flight caps, queue size) may change; what the defaults mean may not.
    cfg = load_config()
    assert cfg == Config()
    assert cfg.model.path == "tiny"  # the embedded model: runs with no download
    assert cfg.sampling == Sampling()
    assert cfg.sampling.stop_token_ids == [2]  # the tiny model's <eos>
    assert cfg.sampling.n <= cfg.engines.max_inflight_per_engine
    assert cfg.prompts.source == "synthetic" and cfg.prompts.path is None
    assert cfg.reward is None
    assert cfg.ray.address is None


def test_yaml_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "engines:\n  count: 3\n  max_inflight_per_engine: 16\n"
        'sampling:\n  n: 2\n  temperature: 0.5\n  stop: ["\\n"]\n'
        "queue:\n  max_groups: 8\n"
    )
    cfg = load_config(path)
    assert cfg.engines.count == 3
    assert cfg.engines.max_inflight_per_engine == 16
    assert cfg.sampling.n == 2
    assert cfg.sampling.temperature == 0.5
    assert cfg.sampling.stop == ["\n"]
    assert cfg.queue.max_groups == 8
    assert cfg.model == Config().model  # untouched blocks keep their defaults


def test_empty_yaml_file_is_the_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert load_config(path) == Config()


def test_overrides_are_yaml_typed(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("sampling:\n  n: 2\n")
    cfg = load_config(path, ["sampling.n=8", "sampling.stop=['x']", "sampling.temperature=0", "ray.address=auto"])
    assert cfg.sampling.n == 8  # the override wins over the file
    assert isinstance(cfg.sampling.n, int)
    assert cfg.sampling.stop == ["x"]
    assert cfg.sampling.temperature == 0.0
    assert cfg.ray.address == "auto"


def test_later_override_wins():
    assert load_config(None, ["sampling.n=2", "sampling.n=3"]).sampling.n == 3


def test_dump_round_trips():
    cfg = load_config(None, ["sampling.n=3", "engines.count=1"])
    assert config_from_dict(msgspec.yaml.decode(dump_config(cfg).encode())) == cfg


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["foo=1"], "foo: unknown key"),
        (["engines.foo=1"], "engines.foo: unknown key"),
        (["engines.count=two"], "engines.count: expected `int`, got `str`"),
        (["engines.count=0"], "engines.count: expected `int` >= 1"),
        (["sampling.top_p=1.5"], "sampling.top_p: expected `float` <= 1.0"),
        (["sampling.temperature=.nan"], "sampling.temperature:"),
        (["sampling.temperature=-1"], "sampling.temperature:"),
        (["sampling.min_tokens=20", "sampling.max_tokens=10"], "sampling.min_tokens: 20 exceeds max_tokens 10"),
        (["prompts.source=jsonl"], "prompts.path: required"),
        (["prompts.min_len=10", "prompts.max_len=5"], "prompts.min_len:"),
        (
            ["sampling.n=8", "engines.max_inflight_per_engine=4"],
            "sampling.n: 8 exceeds engines.max_inflight_per_engine 4",
        ),
        (
            ["engines.queued_per_engine=0"],
            "engines.queued_per_engine: expected `int` >= 1",
        ),  # nothing ever waits in vLLM
        (["engines.queued_per_engine=-4"], "engines.queued_per_engine: expected `int` >= 1"),
        (
            ["engines.max_inflight_per_engine=8", "engines.queued_per_engine=9"],
            "engines.queued_per_engine: 9 exceeds engines.max_inflight_per_engine 8",
        ),
        (["model.dtype=fp8"], "model.dtype:"),
        (["sampling.stop_token_ids=[-1]"], "sampling.stop_token_ids[0]:"),
        (["sampling.stop=['x', '']"], "sampling.stop[1]: empty"),
        (["queue=3"], "queue: expected `object`"),
        (["model.path=x", "model.path.y=1"], "model.path: is not a mapping"),
        (["sampling.n=[1"], "sampling.n: cannot parse override value"),
    ],
)
def test_errors_name_the_key_path(overrides, expected):
    with pytest.raises(InvalidConfigError) as e:
        load_config(None, overrides)
    assert str(e.value).startswith(expected), str(e.value)


def test_unknown_key_in_a_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("engines:\n  count: 1\n  foo: 2\n")
    with pytest.raises(InvalidConfigError, match=r"^engines\.foo: unknown key$"):
        load_config(path)


@pytest.mark.parametrize("item", ["sampling.n", "=3", " =3"])
def test_malformed_override(item):
    with pytest.raises(InvalidConfigError, match="expected key.path=value"):
        load_config(None, [item])


@pytest.mark.parametrize("text", ["- a\n- b\n", "just a string\n", "3\n"])
def test_non_mapping_yaml(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(InvalidConfigError, match="expected a mapping at the top level"):
        load_config(path)


def test_invalid_yaml_names_the_file(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("engines: [1\n")
    with pytest.raises(InvalidConfigError, match="broken.yaml: not valid YAML"):
        load_config(path)


def test_missing_file():
    with pytest.raises(FileNotFoundError):
        load_config("/nonexistent/config.yaml")


def test_invalid_config_error_is_a_value_error():
    with pytest.raises(ValueError):
        load_config(None, ["engines.count=0"])


def test_repo_configs_all_load():
    paths = sorted((REPO / "configs").glob("*.yaml"))
    names = [p.name for p in paths]
    assert "tiny.yaml" in names, f"configs/ must hold at least tiny.yaml, found {names}"
    for path in paths:
        cfg = load_config(path)
        assert isinstance(cfg, Config), path


def test_a_packaged_config_loads_by_name_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no configs/ here: the name is not a path
    assert packaged_config_names() == sorted(p.stem for p in (REPO / "configs").glob("*.yaml"))
    assert load_config("tiny", ["sampling.n=4"]) == load_config(REPO / "configs" / "tiny.yaml", ["sampling.n=4"])
    assert load_config("multiturn").env == "rollout.episodes.examples:Observations"
    (tmp_path / "mine.yaml").write_text("engines: {count: 1}\n")
    assert load_config("mine.yaml").engines.count == 1  # a suffix or a folder makes it a path


def test_an_unknown_config_name_lists_the_packaged_ones():
    with pytest.raises(FileNotFoundError, match=r"no packaged config named 'tinyy' \(packaged: gpu, .*tiny\)"):
        load_config("tinyy")
    with pytest.raises(FileNotFoundError):
        load_config("no/such.yaml")


# --- speculative decoding ---------------------------------------------------------------------


def test_speculative_is_off_by_default_and_translates_to_vllm():
    assert not Config().speculative.enabled and Config().speculative.vllm_config() is None
    cfg = load_config(
        None, ["speculative.method=ngram", "speculative.num_speculative_tokens=3", "speculative.prompt_lookup_max=4"]
    )
    assert cfg.speculative.vllm_config() == {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
    gpu = load_config(
        None,
        [
            "speculative={method: eagle3, model: /m/head, num_speculative_tokens: 2, "
            "options: {draft_tensor_parallel_size: 1}}"
        ],
    )
    assert gpu.speculative.vllm_config() == {
        "method": "eagle3",
        "model": "/m/head",
        "num_speculative_tokens": 2,
        "draft_tensor_parallel_size": 1,
    }


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (
            ["speculative.method=foo", "speculative.num_speculative_tokens=3"],
            "speculative.method: unknown speculative method 'foo'",
        ),
        (
            ["speculative.method=ngram", "speculative.num_speculative_tokens=0"],
            "speculative.num_speculative_tokens: expected `int` >= 1",
        ),
        (
            ["speculative.method=ngram", "speculative.num_speculative_tokens=-2"],
            "speculative.num_speculative_tokens: expected `int` >= 1",
        ),
        (["speculative.method=ngram"], "speculative.num_speculative_tokens: required for method 'ngram'"),
        (["speculative.num_speculative_tokens=3"], "speculative.method: required"),
        (
            ["speculative.method=eagle", "speculative.num_speculative_tokens=3"],
            "speculative.model: required for method 'eagle'",
        ),
        (
            ["speculative.method=ngram", "speculative.num_speculative_tokens=3", "speculative.prompt_lookup_min=0"],
            "speculative.prompt_lookup_min: expected `int` >= 1",
        ),
        (
            [
                "speculative.method=ngram",
                "speculative.num_speculative_tokens=3",
                "speculative.prompt_lookup_min=4",
                "speculative.prompt_lookup_max=2",
            ],
            "speculative.prompt_lookup_min: 4 exceeds prompt_lookup_max 2",
        ),
        (
            ["speculative.method=mtp", "speculative.prompt_lookup_max=2"],
            "speculative.prompt_lookup_max: only for the ngram methods",
        ),
        (
            ["speculative.method=ngram", "speculative.num_speculative_tokens=3", "speculative.options={method: x}"],
            "speculative.options.method: set speculative.method",
        ),
        (["speculative.methd=ngram"], "speculative.methd: unknown key"),
        (
            ["engines.vllm.speculative_config={method: ngram, num_speculative_tokens: 3}"],
            "engines.vllm.speculative_config: configure speculative decoding in the `speculative:` block",
        ),
        (["engines.vllm.spec_method=ngram"], "engines.vllm.spec_method: configure speculative decoding"),
    ],
)
def test_bad_speculative_settings_name_the_key(overrides, expected):
    with pytest.raises(InvalidConfigError) as e:
        load_config(None, overrides)
    assert str(e.value).startswith(expected), str(e.value)


@pytest.mark.parametrize(
    "override, message",
    [("sampling.stop_token_ids=[2, 260]", "sampling.stop_token_ids[1]: 260 outside the vocabulary (vocab size 260)"),
     ("sampling.stop=['']", "sampling.stop[0]: empty")],
)  # fmt: skip
def test_validate_checks_stop_conditions_against_the_model(override, message, capsys):
    from rollout.cli import main

    assert main(["validate", "configs/tiny.yaml", "-o", override]) == 2  # before: "ok"
    assert message in capsys.readouterr().err


def test_the_queue_depth_defaults_to_a_whole_batch_per_engine():
    """16 queued requests per engine covered no engine-driver round trip; a wave of a
    whole batch ending together drained the engine. The default covers one."""
    assert load_config(None).engines.queue_depth == 256
    assert load_config(None, ["engines.max_inflight_per_engine=64"]).engines.queue_depth == 64
    assert load_config(None, ["engines.queued_per_engine=8"]).engines.queue_depth == 8
